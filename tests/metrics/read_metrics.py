"""Reads the event file write_metrics made with TensorBoard's own reader (EventAccumulator) and
compares every scalar of every step with rank 0's reports; then draws both the event directory and
a JSON lines file with scripts/plot_metrics.py and checks the pictures.
Usage: read_metrics.py WRITE_METRICS_PROGRAM WORK_DIR PLOT_SCRIPT"""
import json
import math
import pathlib
import shutil
import struct
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def png_size(path):
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def main():
    program, work, plot = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log_dir, expected_path = work / "run", work / "expected.jsonl"
    subprocess.run([program, str(log_dir), str(expected_path)], check=True)
    expected = [json.loads(line) for line in expected_path.read_text().splitlines()]
    assert len(expected) == 6, expected

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    wanted = set(expected[0]) - {"step"}
    assert tags == wanted, f"tags {sorted(tags)} != {sorted(wanted)}"
    compared = 0
    for tag in sorted(wanted):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [e["step"] for e in expected], (tag, scalars)
        for s, e in zip(scalars, expected):
            want = e[tag]
            if want is None:  # a norm that was not finite
                assert math.isinf(s.value) or math.isnan(s.value), (tag, s)
                continue
            want32 = struct.unpack("f", struct.pack("f", want))[0]  # TensorBoard's scalars are float32
            assert s.value == want32, f"{tag} at step {s.step}: {s.value} != {want32}"
            compared += 1
    skipped = [e["step"] for e in expected if e["applied"] == 0]
    assert skipped == [4], skipped
    print(f"TensorBoard's reader: {len(tags)} scalars x {len(expected)} steps, {compared} values equal")

    # The plots: from the event directory and from a JSON lines file (the expected one).
    for source, picture in ((log_dir, work / "from_events.png"), (expected_path, work / "from_jsonl.png")):
        subprocess.run([sys.executable, plot, str(source), str(picture)], check=True)
        width, height = png_size(picture)
        assert width >= 600 and height >= 400, (picture, width, height)
        print(f"plot of {source.name}: {width}x{height} PNG")
    print("metrics read back: passed")


if __name__ == "__main__":
    main()
