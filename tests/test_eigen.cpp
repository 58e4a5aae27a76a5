// The Eigen adapter: an Eigen trainer (a linear model whose weight is an Eigen::MatrixXd and
// whose bias is an Eigen::Map over memory of its own) trained on N ranks equals one process on
// the whole batch, every rank bitwise identical; and what gradsync cannot read as one block is
// refused, naming the parameter.
#include <gradsync/eigen.hpp>
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include <Eigen/Core>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int inputs = 6, outputs = 3, micro_batch = 8, steps = 10;

struct EigenModel {
    Eigen::MatrixXd w = Eigen::MatrixXd::Zero(outputs, inputs), gw = Eigen::MatrixXd::Zero(outputs, inputs);
    std::vector<double> bias_memory = std::vector<double>(outputs), grad_memory = std::vector<double>(outputs);
    Eigen::Map<Eigen::VectorXd> b{bias_memory.data(), outputs}, gb{grad_memory.data(), outputs};

    explicit EigenModel(int seed) {
        for (int i = 0; i < w.size(); ++i) w.data()[i] = 0.1 * ((i * 7 + seed * 13) % 11 - 5);
        for (int i = 0; i < outputs; ++i) b[i] = 0.05 * (i + seed);
    }
    EigenModel(const EigenModel&) = delete;

    std::vector<gradsync::Parameter> parameters() {
        return {gradsync::parameter("w", w, gw), gradsync::parameter("b", b, gb)};
    }

    // Mean squared error over the batch's columns; the gradients of its mean.
    void forward_backward(const Eigen::MatrixXd& x, const Eigen::MatrixXd& y) {
        const Eigen::MatrixXd err = (w * x).colwise() + Eigen::VectorXd(b) - y;
        const double n = static_cast<double>(x.cols());
        gw = err * x.transpose() / n;
        gb = err.rowwise().sum() / n;
    }
    void sgd(double lr) {
        w -= lr * gw;
        b -= lr * gb;
    }
};

// Step s's columns [first, first + count) of a fixed data set: y = A x + c plus a wiggle.
void batch(int s, int first, int count, Eigen::MatrixXd& x, Eigen::MatrixXd& y) {
    x.resize(inputs, count);
    y.resize(outputs, count);
    for (int c = 0; c < count; ++c) {
        const int k = s * 1000 + first + c;
        for (int i = 0; i < inputs; ++i) x(i, c) = ((k * 31 + i * 17) % 23) / 11.0 - 1.0;
        for (int o = 0; o < outputs; ++o) y(o, c) = x.col(c).sum() * (o + 1) * 0.3 + 0.01 * ((k + o) % 5);
    }
}

std::uint64_t bits(const EigenModel& m) {
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&](const double* p, Eigen::Index n) {
        for (Eigen::Index i = 0; i < n; ++i) {
            std::uint64_t u;
            std::memcpy(&u, p + i, 8);
            h = (h ^ u) * 1099511628211ull;
        }
    };
    mix(m.w.data(), m.w.size());
    mix(m.b.data(), m.b.size());
    return h;
}

}  // namespace

TEST_CASE("an Eigen trainer on N ranks equals one process on the whole batch") {
    for (int world = 1; world <= 4; ++world) {
        CAPTURE(world);
        EigenModel single(/*seed=*/0);
        Eigen::MatrixXd x, y;
        for (int s = 0; s < steps; ++s) {
            batch(s, 0, world * micro_batch, x, y);
            single.forward_backward(x, y);
            single.sgd(0.1);
        }
        std::vector<std::vector<std::uint64_t>> hashes(static_cast<std::size_t>(world));
        Eigen::MatrixXd w0;
        Eigen::VectorXd b0;
        gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
            EigenModel model(/*seed=*/backend.rank());  // rank 0's values reach every rank
            gradsync::DataParallel dp(model, backend);
            Eigen::MatrixXd xr, yr;
            for (int s = 0; s < steps; ++s) {
                batch(s, backend.rank() * micro_batch, micro_batch, xr, yr);
                model.forward_backward(xr, yr);
                dp.step([&] { model.sgd(0.1); });
                hashes[static_cast<std::size_t>(backend.rank())].push_back(bits(model));
            }
            if (backend.rank() == 0) {
                w0 = model.w;
                b0 = model.b;
            }
        });
        CHECK((w0 - single.w).cwiseAbs().maxCoeff() <= 1e-12 * std::max(1.0, single.w.cwiseAbs().maxCoeff()));
        CHECK((b0 - single.b).cwiseAbs().maxCoeff() <= 1e-12 * std::max(1.0, single.b.cwiseAbs().maxCoeff()));
        CHECK((EigenModel(0).w - single.w).cwiseAbs().maxCoeff() > 1e-3);  // training moved the weights
        for (int r = 1; r < world; ++r) CHECK(hashes[static_cast<std::size_t>(r)] == hashes[0]);
    }
}

TEST_CASE("Eigen parameters: dtypes, and what cannot be read as one block") {
    Eigen::MatrixXf wf(3, 4), gf(3, 4);
    const auto p = gradsync::parameter("wf", wf, gf);
    CHECK(p.dtype == gradsync::DType::float32);
    CHECK(p.count == 12);
    CHECK(p.data == wf.data());
    CHECK(p.grad == gf.data());
    Eigen::ArrayXXd a(2, 5), ga(2, 5);
    CHECK(gradsync::parameter("a", a, ga).dtype == gradsync::DType::float64);
    Eigen::RowVectorXf r(7), gr(7);
    CHECK(gradsync::parameter("r", r, gr).count == 7);
    // The shape of the memory read row-major: a checkpoint saves it.
    using Shape = std::vector<std::size_t>;
    CHECK(p.shape == Shape{4, 3});  // column-major: its memory is the transpose's
    Eigen::Matrix<float, 3, 4, Eigen::RowMajor> rm, grm;
    CHECK(gradsync::parameter("rm", rm, grm).shape == Shape{3, 4});
    CHECK(gradsync::parameter("r", r, gr).shape == Shape{7});

    Eigen::MatrixXd big(6, 6), gbig(6, 6), small(2, 3);
    CHECK_THROWS_WITH_AS(gradsync::parameter("blk", big.block(1, 1, 2, 2), gbig.block(1, 1, 2, 2)),
                         doctest::Contains("parameter 'blk': its values do not lie contiguously"),
                         gradsync::InvalidModel);
    CHECK_THROWS_WITH_AS(gradsync::parameter("odd", small, gbig),
                         doctest::Contains("parameter 'odd' has 6 values but 36 gradient elements"),
                         gradsync::InvalidModel);
    std::vector<double> blob(12), gblob(12);  // an llm.c-style blob seen as a 3x4 matrix
    Eigen::Map<Eigen::MatrixXd> m(blob.data(), 3, 4), gm(gblob.data(), 3, 4);
    CHECK(gradsync::parameter("m", m, gm).data == blob.data());
    Eigen::Map<Eigen::VectorXd, 0, Eigen::InnerStride<2>> strided(blob.data(), 6), gstrided(gblob.data(), 6);
    CHECK_THROWS_AS(gradsync::parameter("strided", strided, gstrided), gradsync::InvalidModel);
    // Whole columns of a column-major matrix are contiguous: accepted.
    CHECK(gradsync::parameter("col", big.col(2), gbig.col(2)).data == big.data() + 12);
}
