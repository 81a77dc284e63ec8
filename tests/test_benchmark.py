"""Tests of the performance harness (keras_mp/cli/benchmark.py): records, speedups, errors.

No timing assertions: the harness runs two tiny workloads for two steps, in process.
"""

import json
import pathlib
import re

import keras
import pytest

from keras_mp.cli import benchmark

FIELDS = {
    "model",
    "policy",
    "backend",
    "device",
    "jit_compile",
    "compile_s",
    "step_ms_median",
    "step_ms_min",
    "units",
    "units_per_s",
    "tflops",
    "peak_mem_gib",
    "peak_mem_kind",
    "loss",
    "params",
    "optimizer",
    "speedup_vs_fp32",
    "speedup_vs_best_fp32",
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.jsonl"
    status = benchmark.main(
        [
            "--models",
            "tiny_gpt,tiny_resnet",
            "--policies",
            "keras_mp_mixed_bfloat16,float32",  # run order puts float32 first
            "--steps",
            "2",
            "--warmup",
            "0",
            "--in-process",  # default jit_compile
            "--backend",
            keras.backend.backend(),
            "--out",
            str(out),
        ]
    )
    assert status == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _tf_cpu_allocator_has_stats() -> bool:
    """TensorFlow's CPU allocator keeps statistics only where oneDNN is on (by default on CPUs
    with AVX512 neural-network instructions, not on AVX2-only ones); JAX has none on CPU."""
    if keras.backend.backend() != "tensorflow":
        return False
    from keras_mp.cli import records

    records.reset_peak_memory("CPU")
    return records.peak_memory("CPU") is not None


def test_one_record_per_configuration_with_all_fields(rows):
    assert [(r["model"], r["policy"]) for r in rows] == [
        ("tiny_gpt", "float32"),
        ("tiny_gpt", "keras_mp_mixed_bfloat16"),
        ("tiny_resnet", "float32"),
        ("tiny_resnet", "keras_mp_mixed_bfloat16"),
    ]
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["backend"] == keras.backend.backend()
        # XLA, except TensorFlow on CPU for float32/bfloat16 (oneDNN is faster there).
        assert r["jit_compile"] is (keras.backend.backend() != "tensorflow")
        assert 0 < r["step_ms_min"] <= r["step_ms_median"]
        assert r["peak_mem_kind"] == "host_rss" and r["peak_mem_gib"] > 0.05  # CPU: RSS
        if _tf_cpu_allocator_has_stats():  # TF's allocator over the timed steps
            assert 0 < r["tensor_peak_mib"] < r["peak_mem_gib"] * 1024
        else:
            assert "tensor_peak_mib" not in r
        assert r["loss"] == pytest.approx(r["loss"]) and 0 < r["loss"] < 20  # finite
    gpt, resnet = rows[0], rows[2]
    assert gpt["units"] == "tokens" and resnet["units"] == "images"
    # tiny_gpt: 2 x 64 tokens; N = 1 layer x (4*64^2 + 2*64*128) + 512*64 = 65536.
    tokens = 2 * 64
    flops = 6 * 65536 * tokens + 12 * 1 * 64 * 64 * tokens
    assert gpt["units_per_s"] == pytest.approx(tokens / (gpt["step_ms_median"] / 1e3), rel=1e-2)
    assert gpt["tflops"] == pytest.approx(
        flops / (gpt["step_ms_median"] / 1e3) / 1e12, rel=2e-2, abs=1e-4
    )


def test_speedups_are_against_rows_of_the_same_run(rows):
    for fp32, mixed in (rows[0:2], rows[2:4]):
        assert fp32["speedup_vs_fp32"] == 1.0 and fp32["speedup_vs_best_fp32"] == 1.0
        expected = round(fp32["step_ms_median"] / mixed["step_ms_median"], 3)
        assert mixed["speedup_vs_fp32"] == pytest.approx(expected, abs=1e-3)
        assert mixed["speedup_vs_stock"] is None  # no stock row was measured
        assert mixed["keep_fp32"] == "default"


def test_keras_mp_row_runs_the_keep_list(rows):
    # Same weights and data: the FP32-pinned bfloat16 loss stays close to the float32 one.
    for fp32, mixed in (rows[0:2], rows[2:4]):
        assert mixed["loss"] == pytest.approx(fp32["loss"], rel=0.05)
        assert mixed["params"] == fp32["params"]


def test_stock_reference_and_best_fp32():
    earlier = [
        {"model": "m", "policy": "float32", "jit_compile": False, "step_ms_median": 100.0},
        {"model": "m", "policy": "float32", "jit_compile": True, "step_ms_median": 80.0},
        {
            "model": "m",
            "policy": "stock_mixed_float16",
            "jit_compile": True,
            "step_ms_median": 50.0,
        },
        {"model": "other", "policy": "float32", "jit_compile": True, "step_ms_median": 1.0},
    ]
    row = benchmark.add_speedups(
        {
            "model": "m",
            "policy": "keras_mp_mixed_float16",
            "jit_compile": True,
            "step_ms_median": 40.0,
        },
        earlier,
    )
    assert row["speedup_vs_fp32"] == 2.0  # the float32 row with the same jit_compile
    assert row["speedup_vs_best_fp32"] == 2.0
    assert row["speedup_vs_stock"] == 1.25
    row = benchmark.add_speedups(
        {
            "model": "m",
            "policy": "stock_mixed_bfloat16",
            "jit_compile": False,
            "step_ms_median": 50.0,
        },
        earlier,
    )
    assert (row["speedup_vs_fp32"], row["speedup_vs_best_fp32"]) == (2.0, 1.6)
    assert row["speedup_vs_stock"] == 1.0


def test_keras_mp_float32_is_an_fp32_reference():
    """`keras_mp_float32` (FP32 model, keras_mp's loss) is compared with stock `float32` and
    counts among the FP32 rows that `speedup_vs_best_fp32` takes the fastest of."""
    earlier = [{"model": "m", "policy": "float32", "jit_compile": False, "step_ms_median": 100.0}]
    ours = benchmark.add_speedups(
        {"model": "m", "policy": "keras_mp_float32", "jit_compile": False,
         "step_ms_median": 80.0},
        earlier,
    )
    assert (ours["speedup_vs_fp32"], ours["speedup_vs_stock"]) == (1.25, 1.25)
    assert ours["speedup_vs_best_fp32"] == 1.0
    mixed = benchmark.add_speedups(
        {"model": "m", "policy": "keras_mp_mixed_bfloat16", "jit_compile": False,
         "step_ms_median": 40.0},
        earlier + [ours],
    )
    assert (mixed["speedup_vs_fp32"], mixed["speedup_vs_best_fp32"]) == (2.5, 2.0)
    assert mixed["speedup_vs_stock"] is None  # no stock bf16 row
    assert not benchmark.default_jit("keras_mp_float32", "tensorflow", False)


def test_keras_mp_float32_row_trains_the_float32_model():
    """Same float32 model, weights and data as the `float32` row; only the loss is keras_mp's
    (float32 math either way): the same first-step loss to float32 rounding."""
    stock = benchmark.run_one("tiny_gpt", "float32", steps=1, warmup=0)
    ours = benchmark.run_one("tiny_gpt", "keras_mp_float32", steps=1, warmup=0)
    assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-5)
    assert ours["jit_compile"] == stock["jit_compile"] and "keep_fp32" not in ours


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--models", "gpt2"], r"Unknown model 'gpt2'\. Valid model names: gpt, resnet50, "),
        (["--policies", "mixed_bfloat16"], r"Unknown policy 'mixed_bfloat16'.*float32_strict"),
        (["--policies", "float32@xla"], r"@jit, @nojit or @remat"),
        (["--env", "TF_ENABLE_ONEDNN_OPTS"], r"KEY=VALUE"),
        (["--steps", "0"], r"--steps must be at least 1"),
    ],
)
def test_bad_names_raise_before_anything_runs(argv, match):
    with pytest.raises(ValueError, match=match):
        benchmark.main(["--in-process", *argv])


def test_run_one_rejects_unknown_names():
    with pytest.raises(ValueError, match="Valid model names: gpt, resnet50, cpu_gpt"):
        benchmark.run_one("resnet18", "float32")
    with pytest.raises(ValueError, match="keras_mp_mixed_float16"):
        benchmark.run_one("tiny_gpt", "float16")


def test_scaler_only_row_is_compared_with_stock_float16():
    """`stock_mixed_float16_kmp_scaler` differs from `stock_mixed_float16` only by the
    optimizer wrapper: its speedup_vs_stock is the loss scaler's own cost."""
    earlier = [
        {"model": "m", "policy": "float32", "jit_compile": True, "step_ms_median": 90.0},
        {"model": "m", "policy": "stock_mixed_float16", "jit_compile": True,
         "step_ms_median": 50.0},
    ]
    row = benchmark.add_speedups(
        {"model": "m", "policy": "stock_mixed_float16_kmp_scaler", "jit_compile": True,
         "step_ms_median": 50.5},
        earlier,
    )
    assert row["speedup_vs_stock"] == pytest.approx(50 / 50.5, abs=1e-3)
    assert benchmark.default_jit("stock_mixed_float16_kmp_scaler", "tensorflow", False)


@pytest.mark.slow
def test_remat_row_runs_in_its_own_process_with_the_xla_flag(tmp_path):
    """`policy@remat`: XLA with the rematerialization memory limit, set in that row's own
    process (the flag must be there before the backend starts); on a CPU the flag changes
    nothing, so the row trains exactly like the plain one. Speedups prefer a reference of
    the same kind."""
    from keras_mp.cli import measure

    flag = measure.REMAT_XLA_FLAG
    assert measure.config_env("float32", {"XLA_FLAGS": "--xla_dump_to=/d"}) == {
        "XLA_FLAGS": "--xla_dump_to=/d"
    }
    assert measure.config_env("float32@remat", {"XLA_FLAGS": "--xla_dump_to=/d"})["XLA_FLAGS"] == (
        f"--xla_dump_to=/d {flag}"
    )
    assert measure.config_env("float32@remat", {"XLA_FLAGS": flag})["XLA_FLAGS"] == flag
    assert measure.config_env("float32@remat", {})["XLA_FLAGS"] == flag
    with pytest.raises(ValueError, match=r"@remat row needs XLA_FLAGS=--xla_gpu_memory_limit"):
        benchmark.main(["--in-process", "--models", "tiny_gpt", "--policies", "float32@remat"])
    out = tmp_path / "remat.jsonl"
    argv = ["--models", "tiny_gpt", "--policies", "float32,float32@remat", "--steps", "1",
            "--warmup", "0", "--backend", keras.backend.backend(), "--out", str(out)]
    assert benchmark.main(argv) == 0
    plain, remat = map(json.loads, out.read_text().splitlines())
    assert (plain["xla_remat"], remat["xla_remat"]) == (False, True)
    assert remat["jit_compile"] is True
    assert flag in remat["env"]["XLA_FLAGS"].split()
    assert flag not in plain["env"].get("XLA_FLAGS", "")
    assert remat["loss"] == pytest.approx(plain["loss"], rel=1e-6)

    def row(policy, ms, remat=False):
        return {"model": "m", "policy": policy, "jit_compile": True, "step_ms_median": ms,
                "xla_remat": remat}

    earlier = [row("float32", 100.0), row("stock_mixed_bfloat16", 50.0)]
    ours = benchmark.add_speedups(row("keras_mp_mixed_bfloat16", 40.0, True), list(earlier))
    assert (ours["speedup_vs_fp32"], ours["speedup_vs_stock"]) == (2.5, 1.25)  # plain refs
    earlier.append(row("stock_mixed_bfloat16", 80.0, True))
    ours = benchmark.add_speedups(row("keras_mp_mixed_bfloat16", 40.0, True), list(earlier))
    assert ours["speedup_vs_stock"] == 2.0  # the stock @remat row


def test_remat_layers_build_each_rows_model_under_a_remat_scope(tmp_path):
    """`--remat-layers`: each row's model is built under `keras.RematScope` naming those
    layers of every block (or of the blocks given); the row records them, the table names
    them, a subprocess row gets them passed on, and the first step's loss is the plain
    model's (recomputation changes no value). On TensorFlow Keras' RematScope cannot run in
    a compiled step: the row says so before building anything."""
    import contextlib

    from keras_mp.cli import measure
    from keras_mp.cli.workloads import WORKLOADS

    scope = measure.remat_scope(WORKLOADS["gpt"], ("attn_", "ffn_in_[0-2]"))
    assert isinstance(scope, keras.RematScope)
    assert scope.layer_names == [f"attn_{i}" for i in range(8)] + [
        "ffn_in_0", "ffn_in_1", "ffn_in_2"]
    assert isinstance(measure.remat_scope(WORKLOADS["gpt"], ()), contextlib.nullcontext)

    args = benchmark.build_parser().parse_args(["--remat-layers", "attn_[0-2]"])
    assert benchmark._passthrough(args)[-2:] == ["--remat-layers", "attn_[0-2]"]
    out = tmp_path / "rows.jsonl"
    argv = ["--in-process", "--models", "tiny_gpt", "--policies", "keras_mp_mixed_bfloat16",
            "--steps", "1", "--warmup", "0", "--backend", keras.backend.backend(),
            "--out", str(out)]
    if keras.backend.backend() == "tensorflow":
        with pytest.raises(ValueError, match="RematScope fails in TensorFlow's compiled step"):
            benchmark.main([*argv, "--remat-layers", "ffn_in_"])
        return
    assert benchmark.main(argv) == 0
    assert benchmark.main([*argv, "--remat-layers", "attn_,ffn_in_"]) == 0
    plain, remat = map(json.loads, out.read_text().splitlines())
    assert plain["remat_layers"] is None
    assert remat["remat_layers"] == ["attn_", "ffn_in_"]
    assert remat["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert "on, RematScope(attn_,ffn_in_)" in benchmark._table([remat])


def _benchmark_script(name: str):
    """The module `benchmarks/<name>.py` (the benchmarks are scripts, not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA analysis through JAX")
def test_xla_memory_script_compiles_without_running(tmp_path, capsys):
    """benchmarks/xla_memory.py at test sizes: one record per configuration; the fused
    keras_mp loss needs less temporary memory than Keras' loss on the same bfloat16 logits."""
    module = _benchmark_script("xla_memory")
    out = tmp_path / "mem.jsonl"
    argv = ["--models", "tiny_gpt", "--policies", "stock_mixed_bfloat16,keras_mp_mixed_bfloat16",
            "--logits", "--out", str(out)]
    assert module.main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    logits = {r["recipe"]: r for r in records if r["kind"] == "logits"}
    steps = [r for r in records if r["kind"] == "step"]
    assert sorted(logits) == ["fp32_head", "keras_mp", "stock"]
    assert logits["keras_mp"]["temp_bytes"] < logits["stock"]["temp_bytes"]
    assert [r["policy"] for r in steps] == ["stock_mixed_bfloat16", "keras_mp_mixed_bfloat16"]
    assert all(r["xla_flops"] > 0 and r["argument_bytes"] > 0 for r in steps)


def test_hlo_traffic_counts_kernels_bytes_and_the_costliest_branch():
    """Bytes per kernel = operands + output; a conditional counts its costliest branch."""
    module = _benchmark_script("hlo_traffic")
    mib = 2**20 // 4  # f32 elements in a MiB
    hlo = f"""HloModule m

%skip (p: (f32[{mib}])) -> (f32[{mib}]) {{
  %p = (f32[{mib}]) parameter(0)
  %g = f32[{mib}]{{0}} get-tuple-element(%p), index=0
  %c = f32[{mib}]{{0}} copy(%g)
  ROOT %t = (f32[{mib}]) tuple(%c)
}}

%d (x: bf16[1024,512], y: bf16[512,1024]) -> bf16[1024,1024] {{
  %x = bf16[1024,512]{{1,0}} parameter(0)
  %y = bf16[512,1024]{{1,0}} parameter(1)
  ROOT %dot = bf16[1024,1024]{{1,0}} dot(%x, %y), lhs_contracting_dims={{1}},
    rhs_contracting_dims={{0}}
}}

%apply (p: (f32[{mib}])) -> (f32[{mib}]) {{
  %p = (f32[{mib}]) parameter(0)
  %g = f32[{mib}]{{0}} get-tuple-element(%p), index=0
  %loop_fusion = f32[{mib}]{{0}} fusion(%g, %g), kind=kLoop, calls=%f
  ROOT %t = (f32[{mib}]) tuple(%loop_fusion)
}}

ENTRY %main (a: f32[{mib}], b: bf16[1024,512], w: bf16[512,1024], k: pred[]) -> f32[{mib}] {{
  %a = f32[{mib}]{{0}} parameter(0)
  %b = bf16[1024,512]{{1,0}} parameter(1)
  %w = bf16[512,1024]{{1,0}} parameter(2)
  %k = pred[] parameter(3)
  %gemm_fusion_dot = bf16[1024,1024]{{1,0}} fusion(%b, %w), kind=kCustom, calls=%d
  %tup = (f32[{mib}]) tuple(%a)
  %cond = (f32[{mib}]) conditional(%k, %tup, %tup), true_computation=%apply, false_computation=%skip
  ROOT %r = f32[{mib}]{{0}} get-tuple-element(%cond), index=0
}}
"""
    traffic = module.kernel_traffic(hlo)
    assert traffic["gemm"] == {"kernels": 1, "gib": round(4 / 1024, 3)}  # 1 + 1 + 2 MiB
    assert traffic["other"] == {"kernels": 1, "gib": round(3 / 1024, 3)}  # the apply branch
    assert traffic["attention"] == traffic["conv"] == {"kernels": 0, "gib": 0.0}
    assert traffic["conditionals"] == 1 and traffic["copies"] == 0


def _has_xla_gpu_compiler() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA analysis through JAX")
def test_xla_memory_target_needs_the_gpu_compiler_or_says_so(tmp_path):
    """`--target h200` compiles for XLA:GPU without a GPU; without JAX's CUDA plugin it
    stops with a message that names the plugin, and a target file that does not parse is
    named too."""
    module = _benchmark_script("xla_memory")
    argv = ["--target", "h200", "--models", "tiny_gpt", "--policies", "float32"]
    if not _has_xla_gpu_compiler():
        with pytest.raises(SystemExit, match=r"jax\[cuda12\]"):
            module.main(argv)
    bad = tmp_path / "bad.txtpb"
    bad.write_text("gpu_device_info { core_countx: 1 }\n")
    with pytest.raises(SystemExit, match="cannot compile for XLA:GPU"):
        module.target_sharding(str(bad))
    with pytest.raises(FileNotFoundError):
        module.target_sharding(str(tmp_path / "missing.txtpb"))


@pytest.mark.skipif(
    keras.backend.backend() != "jax" or not _has_xla_gpu_compiler(),
    reason="needs JAX's CUDA plugin (XLA:GPU compiles without a GPU); not in CI",
)
def test_xla_memory_compiles_for_an_h200_without_one(tmp_path):
    """The small GPT, for the H200: cuDNN flash attention in the step (as Keras chooses on
    that GPU); keras_mp's step needs a third less temporary memory than stock Keras' (191
    vs 129 MB: its GELU keeps one input-sized tensor for the backward pass, not three) and
    moves less; and keras_mp's loss scaler costs less than Keras': no conditional, no copy
    of the weights, no more bytes, and one finiteness check per shape rather than per
    variable (it was 216 copies, +16% of element-wise traffic and 564 against 331 kernels;
    now 277)."""
    module = _benchmark_script("xla_memory")
    out = tmp_path / "h200.jsonl"
    policies = ["stock_mixed_bfloat16", "keras_mp_mixed_bfloat16", "stock_mixed_float16",
                "stock_mixed_float16_kmp_scaler"]
    argv = ["--target", "h200", "--models", "cpu_gpt", "--out", str(out),
            "--policies", ",".join(policies)]
    assert module.main(argv) == 0
    rows = {r["policy"]: r for r in map(json.loads, out.read_text().splitlines())}
    stock, ours = rows["stock_mixed_bfloat16"], rows["keras_mp_mixed_bfloat16"]
    assert stock["device"] == ours["device"] == "h200 (compile only: NVIDIA H200)"
    assert stock["flash_attention_calls"] == ours["flash_attention_calls"] == 8  # 4 layers
    assert ours["temp_bytes"] < 0.75 * stock["temp_bytes"]
    assert ours["traffic_gib"]["other"] < stock["traffic_gib"]["other"]
    keras_scaler, kmp_scaler = rows["stock_mixed_float16"], rows["stock_mixed_float16_kmp_scaler"]
    assert kmp_scaler["conditionals"] == keras_scaler["conditionals"] == 0
    assert kmp_scaler["copies"] <= keras_scaler["copies"] + 2
    assert kmp_scaler["traffic_gib"]["other"] <= 1.01 * keras_scaler["traffic_gib"]["other"]
    assert kmp_scaler["kernels"]["other"] < 0.9 * keras_scaler["kernels"]["other"]


@pytest.mark.skipif(
    keras.backend.backend() != "jax" or not _has_xla_gpu_compiler(),
    reason="needs JAX's CUDA plugin (XLA:GPU compiles without a GPU); not in CI",
)
def test_xla_memory_remat_rows_trade_element_wise_bytes_for_memory(tmp_path):
    """`policy@remat` compiles with the harness' memory limit: for a GPU whose memory makes
    the limit bind (the H200's description with 3000 MiB, so that the small GPT is where the
    real one is on an H200), XLA recomputes element-wise tensors and needs less temporary
    memory (-17%), moving more bytes in element-wise kernels (+8%)."""
    module = _benchmark_script("xla_memory")
    target = tmp_path / "small.txtpb"
    text = (pathlib.Path(module.TARGETS["h200"])).read_text()
    target.write_text(re.sub(r"device_memory_size: \d+", f"device_memory_size: {3000 << 20}",
                             text))
    out = tmp_path / "remat.jsonl"
    argv = ["--target", str(target), "--models", "cpu_gpt", "--out", str(out),
            "--policies", "keras_mp_mixed_bfloat16,keras_mp_mixed_bfloat16@remat"]
    assert module.main(argv) == 0
    plain, remat = map(json.loads, out.read_text().splitlines())
    assert plain["xla_options"] is None
    assert remat["xla_options"] == {"xla_gpu_memory_limit_slop_factor": 5}
    assert remat["policy"] == plain["policy"] == "keras_mp_mixed_bfloat16"
    assert remat["temp_bytes"] < 0.9 * plain["temp_bytes"]
    assert remat["traffic_gib"]["other"] > plain["traffic_gib"]["other"]
    # Matmuls are not what it recomputes (3 small GEMM kernels more here; none at GPT size).
    assert remat["traffic_gib"]["gemm"] < 1.02 * plain["traffic_gib"]["gemm"]
    assert remat["flash_attention_calls"] == plain["flash_attention_calls"] == 8


@pytest.mark.slow
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's profiler")
def test_tf_profile_script_reads_ops_and_allocator_peak(capsys):
    """benchmarks/tf_profile.py at test size: one record per policy with TF's allocator peak
    and the op types of the profiled steps; the keras_mp step runs the chunked oneDNN loss
    (softmax, no SparseSoftmaxCrossEntropyWithLogits), the stock step TF's native kernel, and
    keras_mp's GELU kernel is a pair of XLA clusters."""
    module = _benchmark_script("tf_profile")
    argv = ["--models", "tiny_gpt", "--policies", "stock_mixed_bfloat16,keras_mp_mixed_bfloat16",
            "--steps", "2", "--warmup", "1", "--top", "100"]
    assert module.main(argv) == 0
    stock, ours = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (stock["policy"], ours["policy"]) == ("stock_mixed_bfloat16", "keras_mp_mixed_bfloat16")
    for record in (stock, ours):
        assert record["step_ms_median"] > 0 and record["host_rss_peak_gib"] > 0.1
        assert max(record["tensor_peak_mib"].values()) > 0
    assert "SparseSoftmaxCrossEntropyWithLogits" in stock["top_ops_ms_per_step"]
    assert "SparseSoftmaxCrossEntropyWithLogits" not in ours["top_ops_ms_per_step"]
    assert any("Softmax" in op for op in ours["top_ops_ms_per_step"])
    # keras_mp's GELU runs as XLA clusters (forward + backward; tiny_gpt's 2 x 64 x 128 values
    # are just enough, its layer norms too few and take Keras' ops), counted once each, not
    # again by the XLA events inside them.
    assert ours["top_ops_ms_per_step"]["XLA cluster (async op)"][1] == 2
    assert "Erfc" in stock["top_ops_ms_per_step"] and "Erfc" not in ours["top_ops_ms_per_step"]
    assert not any("fusion" in op or "::" in op for op in ours["top_ops_ms_per_step"])


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_kernel__5x_cublas",
         "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "gemm"),
        ("gemm_fusion_dot_12", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7", "attention"),
        ("sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_kernel_cudnn", "conv"),
        ("sm80_xmma_fprop_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "conv"),
        ("loop_convert_fusion_17", "other"),
        ("input_reduce_fusion_3", "other"),
        ("MemcpyH2D", "copy"),
    ],
)
def test_jax_profile_kinds_of_kernels(name, kind):
    """Kernel names as the profiler records them on a GPU (cuBLAS, cuDNN, XLA fusions): a
    convolution's implicit GEMM is a convolution, a convert fusion is element-wise work."""
    assert _benchmark_script("jax_profile").kernel_kind(name) == kind


@pytest.mark.slow
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's profiler")
def test_jax_profile_script_sums_kernels_per_step(tmp_path, capsys):
    """benchmarks/jax_profile.py at test size, on this CPU (the host's XLA thunks stand in for
    a GPU's kernels): per-step totals by kind that add up to the busy time, the thunks that
    enclose others left out; an unknown policy is an error record and exit status 1."""
    module = _benchmark_script("jax_profile")
    out = tmp_path / "profile.jsonl"
    argv = ["--models", "tiny_gpt", "--policies", "keras_mp_mixed_bfloat16", "--steps", "2",
            "--top", "4", "--out", str(out)]
    assert module.main(argv) == 0
    (record,) = map(json.loads, out.read_text().splitlines())
    assert record["plane"] == "/host:CPU" and record["policy"] == "keras_mp_mixed_bfloat16"
    assert record["kernels_per_step"] > 50  # one tiny GPT step: ~270 thunks
    assert sum(record["ms_per_step"].values()) == pytest.approx(
        record["busy_ms_per_step"], abs=0.01
    )
    assert 0 < record["busy_ms_per_step"] < 4 * record["step_ms_median"]
    assert len(record["top_kernels"]) == 4
    assert not any(k["name"].startswith("ThunkExecutor") for k in record["top_kernels"])
    capsys.readouterr()
    assert module.main(["--models", "tiny_gpt", "--policies", "float16", "--steps", "1"]) == 1
    (error,) = map(json.loads, capsys.readouterr().out.splitlines())
    assert "Unknown policy 'float16'" in error["error"]


def test_stock_rows_are_stock_keras_with_keras_mp_imported():
    """Importing keras_mp gives Keras' own mixed_bfloat16 its skip-only scaler; the
    harness' stock rows must not have it (they are what Keras does without keras_mp)."""
    from keras_mp.cli.measure import model_and_batch
    from keras_mp.cli.workloads import WORKLOADS

    kinds = {}
    for policy in ("stock_mixed_bfloat16", "stock_mixed_float16", "keras_mp_mixed_bfloat16"):
        model, _, _ = model_and_batch(WORKLOADS["tiny_gpt"], policy, True)
        kinds[policy] = type(model.optimizer).__module__.split(".")[0]
    assert kinds == {
        "stock_mixed_bfloat16": "keras",  # plain AdamW
        "stock_mixed_float16": "keras",  # Keras' own LossScaleOptimizer
        "keras_mp_mixed_bfloat16": "keras_mp",
    }
    assert keras.config.dtype_policy().name == "float32"  # restored
