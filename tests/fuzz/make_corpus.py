#!/usr/bin/env python3
"""Writes the fuzz target's seed corpus (corpus/: valid checkpoints of its model, which the fuzzer
mutates) and the hand-made hostile inputs (regressions/: one per class of damage the reader must
refuse). Every input that ever made the target fail goes into regressions/ too, as it was found.

usage: make_corpus.py   (writes next to this script)
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def safetensors(header, data=b""):
    text = json.dumps(header, separators=(",", ":")).encode() if not isinstance(header, bytes) else header
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def model(metadata, w=None, v=None, moment=None):
    w = w or [1.0] * 6
    v = v or [2.0] * 2
    moment = moment or [0.5] * 3
    data = struct.pack("<6f", *w) + struct.pack("<2d", *v) + struct.pack("<3f", *moment)
    header = {
        "__metadata__": metadata,
        "w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]},
        "v": {"dtype": "F64", "shape": [2], "data_offsets": [24, 40]},
        "moment": {"dtype": "F32", "shape": [3], "data_offsets": [40, 52]},
    }
    return header, data


FULL = {"format": "pt", "gradsync.step": "7", "gradsync.world_size": "2", "gradsync.loss_scale": "1024",
        "gradsync.good_steps": "3", "gradsync.bad_steps": "0", "gradsync.sampler.epoch": "1",
        "gradsync.sampler.seed": "42"}


def write(folder, name, content):
    os.makedirs(os.path.join(HERE, folder), exist_ok=True)
    with open(os.path.join(HERE, folder, name), "wb") as f:
        f.write(content)


def main():
    write("corpus", "valid.safetensors", safetensors(*model(FULL)))
    write("corpus", "valid_2d.safetensors", safetensors(*model(dict(FULL, **{"gradsync.step": "0"}))))
    header, data = model(FULL)
    bad = {
        "shape_overflow": dict(header, w={"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}),
        "shape_product_overflow": dict(header, w={"dtype": "F64", "shape": [2**61, 1], "data_offsets": [0, 0]}),
        "offsets_reversed": dict(header, w={"dtype": "F32", "shape": [6], "data_offsets": [24, 0]}),
        "offsets_huge": dict(header, w={"dtype": "F32", "shape": [6], "data_offsets": [2**64 - 24, 2**64 - 1]}),
        "offsets_negative": dict(header, w={"dtype": "F32", "shape": [6], "data_offsets": [-24, 0]}),
        "overlap": dict(header, v={"dtype": "F64", "shape": [2], "data_offsets": [8, 24]}),
        "shape_float": dict(header, w={"dtype": "F32", "shape": [6.0], "data_offsets": [0, 24]}),
        "dtype_object": dict(header, w={"dtype": {"a": [1, 2, 3]}, "shape": [6], "data_offsets": [0, 24]}),
        "metadata_list": dict(header, __metadata__=[1, 2]),
        "metadata_number": dict(header, __metadata__=dict(FULL, **{"gradsync.step": 7})),
        "scale_inf": dict(header, __metadata__=dict(FULL, **{"gradsync.loss_scale": "inf"})),
        "scale_nan": dict(header, __metadata__=dict(FULL, **{"gradsync.loss_scale": "nan"})),
        "scale_negative": dict(header, __metadata__=dict(FULL, **{"gradsync.loss_scale": "-1"})),
        "counter_out_of_range": dict(header, __metadata__=dict(FULL, **{"gradsync.good_steps": "4294967296"})),
        "step_out_of_range": dict(header, __metadata__=dict(FULL, **{"gradsync.step": "18446744073709551616"})),
        "long_name": dict(header, **{"x" * 10000: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}),
    }
    for name, h in bad.items():
        write("regressions", name + ".safetensors", safetensors(h, data))
    write("regressions", "deep_nesting.safetensors", safetensors(b"[" * 10000 + b"]" * 10000))
    write("regressions", "deep_object.safetensors", safetensors(b'{"a":' * 5000 + b"1" + b"}" * 5000))
    write("regressions", "header_length_huge.safetensors", struct.pack("<Q", 2**63) + b"{}")
    write("regressions", "header_not_json.safetensors", safetensors(b"\x00\xff{not json"))
    write("regressions", "short.safetensors", b"\x01\x02\x03")
    write("regressions", "empty.safetensors", b"")


if __name__ == "__main__":
    main()
