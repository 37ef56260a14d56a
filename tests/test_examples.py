"""Smoke runs of examples/: each runs end to end on the CPU in seconds, with its own assertions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name, *args, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args, "--out", str(tmp_path), "--quiet"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def run_benchmark(name, *args):
    """benchmarks/NAME with ARGS on the checkout's nitrobrew: the finished process (not checked)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=600)


def test_a_missing_dependency_names_the_pip_command(tmp_path):
    # transformers hidden by a package of that name that is not there: the example stops with the pip command.
    fake = tmp_path / "hidden" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'transformers'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "hidden"), str(ROOT)]))
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "distill_hf.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "needs transformers: pip install transformers" in result.stderr, result.stderr
    assert "pip install --no-build-isolation '.[hf]'" in result.stderr


@pytest.mark.parametrize("extra", [[], ["--attention", "0.5"]], ids=["logits", "attention"])
def test_distill_hf(tmp_path, extra):
    pytest.importorskip("transformers")
    out = run_example("distill_hf.py", "--teacher-steps", "60", "--steps", "40", *extra, tmp_path=tmp_path)
    assert "held-out KL" in out and (tmp_path / "loss.csv").exists()
    # The attention term's effect is reported either way: trained, the held-out attention-map KL falls.
    line = next(line for line in out.splitlines() if "held-out attention-map KL" in line)
    before, after = (float(x) for x in line.split(") ")[1].split(" nats")[0].split(" -> "))
    assert ("trained with weight" in line) == bool(extra)
    if extra:
        assert after < before, line


def test_distill_trl(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    out = run_example("distill_trl.py", tmp_path=tmp_path)
    assert "held-out KL" in out


def free_port() -> int:
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def test_distill_trl_under_accelerate_launch(tmp_path):
    # The trainer as users launch it on several processes: accelerate's torchrun launcher, two CPU processes (the
    # Trainer's use_cpu makes accelerate's state MULTI_CPU: DDP over gloo). Every rank asserts the held-out KL fell.
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    pytest.importorskip("accelerate")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip",
               "127.0.0.1", "--main_process_port", str(free_port()), str(ROOT / "examples" / "distill_trl.py"),
               "--out", str(tmp_path), "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trainer: MULTI_CPU over 2 process(es)" in result.stdout, result.stdout
    assert result.stdout.count("held-out KL(teacher || student)") == 2, result.stdout


@pytest.mark.parametrize("extra", [["--dtype", "float32"], ["--dtype", "bfloat16", "--loss", "jsd"]],
                         ids=["float32", "bf16-jsd"])
def test_remote_teacher(tmp_path, extra):
    # A teacher process sends its hidden states over gloo; --check asserts the first step equals the
    # single-process loss and gradients.
    pytest.importorskip("transformers")
    out = run_example("remote_teacher.py", "--check", *extra, tmp_path=tmp_path)
    assert "check: the hidden states received, the loss and every gradient" in out and "bytes a token" in out
    assert (tmp_path / "loss.csv").exists()


@pytest.mark.parametrize("layouts", [[], ["--student", "ddp", "--teacher", "plain", "--loss", "jsd"]],
                         ids=["fsdp2", "ddp"])
def test_distill_fsdp2(tmp_path, layouts):
    # Two CPU processes over gloo, launched as users launch it (torchrun); every rank asserts the held-out KL fell.
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # A static rendezvous on a free port (--standalone's c10d one hung once in CI).
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "--nproc-per-node", "2",
               str(ROOT / "examples" / "distill_fsdp2.py"), "--device", "cpu", *layouts, "--out", str(tmp_path),
               "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "held-out KL(teacher || student)" in result.stdout and (tmp_path / "loss.csv").exists()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_offline_topk(tmp_path, dtype):
    # Pass 1 writes safetensors shards of the teacher's top-K, pass 2 trains from them; --check asserts the
    # loss from a shard equals the live teacher's.
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    out = run_example("offline_topk.py", "--check", "--logprob-dtype", dtype, tmp_path=tmp_path)
    assert "check: the loss from the shard" in out and "bytes a real token on disk" in out
    assert len(list(tmp_path.glob("shard_*.safetensors"))) == 3 and (tmp_path / "loss.csv").exists()


def test_hf_step_benchmark_smoke(tmp_path):
    # benchmarks/hf_step.py's tiny CPU mode: both model pairs built, the losses checked against each other,
    # a step timed per method and T, the CSV written.
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "hf_step.csv"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_step.py"), "--device", "cpu", "--tiny",
                             "--methods", "nitrobrew", "logits", "--check"], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0 and "the losses agree" in result.stdout, result.stdout + result.stderr
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_step.py"), "--device", "cpu", "--tiny",
                             "--model", "qwen", "--methods", "nitrobrew", "logits", "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = out.read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 and all(",ok," in row for row in rows[1:]), rows


def test_offline_topk_trains_at_the_stored_temperature(tmp_path):
    # With K = V a shard holds the teacher's whole distribution: the example's pass-2 loss is then
    # distillation_loss's forward KL at the temperature pass 1 stored (the student's logits divided by it too).
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import importlib.util

    import torch

    import nitrobrew

    spec = importlib.util.spec_from_file_location("offline_topk", ROOT / "examples" / "offline_topk.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    size = dict(example.sizes(False), batches=1)
    teacher, student = example.llama(size["vocab"], *size["teacher"], seed=0), example.llama(size["vocab"],
                                                                                            *size["student"], seed=1)
    (path,) = example.write_shards(teacher, size, tmp_path, size["vocab"], torch.float32, 2.0, "cpu", quiet=True)
    shard = example.read_shard(path, "cpu")
    ids, mask = shard["input_ids"].long(), shard["attention_mask"].long()
    expected = nitrobrew.hf.distillation_loss(student, teacher, ids, attention_mask=mask, temperature=2.0)
    torch.testing.assert_close(example.shard_loss(student, shard), expected, rtol=1e-4, atol=1e-6)


def test_topk_logprobs_benchmark_smoke(tmp_path):
    # benchmarks/topk_logprobs.py on the CPU: the gemm floor and every method at two K, 2 rounds.
    import csv

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "topk_logprobs.csv"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "topk_logprobs.py"), "--device", "cpu",
                             "--shape", "40,300,32", "--topk", "4", "9", "--dtype", "float32", "--rounds", "2",
                             "--repeats", "1", "--warmup", "0", "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 1 + 2 * 5 and all(row["status"] == "ok" for row in rows), rows
    assert all(len(row["round_medians_ms"].split()) == 2 and float(row["ratio_to_gemm"]) > 0 for row in rows), rows


def test_logits_benchmark_smoke(tmp_path):
    # benchmarks/logits.py on the CPU: two dtypes over 2 rounds, each round's copy first; one row a case, its
    # fraction of a copy the median of the rounds' (so within the rounds' spread of bytes / median / copy); a bad
    # --rounds is a usage error.
    import csv

    out = tmp_path / "logits.csv"
    result = run_benchmark("logits.py", "--device", "cpu", "--shape", "16,300", "--dtype", "float32", "bfloat16",
                           "--rounds", 2, "--repeats", 1, "--warmup", 0, "--losses", "forward_kl", "jsd", "--methods",
                           "nitrobrew", "naive", "--topk", 4, "--topk-renormalized", "tvd", "--out", out)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.open()))
    # per dtype: the copy, then (forward_kl, jsd, topk4, topk4:tvd) x 2 modes x 2 methods
    assert len(rows) == 2 * (1 + 4 * 2 * 2) and all(row["status"] == "ok" for row in rows), rows
    assert {row["dtype"] for row in rows} == {"float32", "bfloat16"} and all(row["rounds"] == "2" for row in rows)
    for row in rows:
        has_fraction = row["method"] == "copy" or (row["method"] == "nitrobrew" and ":" not in row["loss"])
        assert bool(row["fraction_of_copy"]) == has_fraction, row
    assert all(float(row["fraction_of_copy"]) == 1.0 for row in rows if row["method"] == "copy")
    bad = run_benchmark("logits.py", "--device", "cpu", "--rounds", 0)
    assert bad.returncode == 2 and "--rounds" in bad.stderr, bad.stderr


def test_topk_linear_benchmark_smoke(tmp_path):
    # benchmarks/topk_linear.py on the CPU: the gemm floor and both methods measured once per round over 2
    # rounds, every ratio taken to the floor of its mode; a bad --rounds is a usage error.
    import csv

    out = tmp_path / "topk_linear.csv"
    result = run_benchmark("topk_linear.py", "--device", "cpu", "--shape", "40,300,32", "--topk", 4, "--dtype",
                           "float32", "--rounds", 2, "--repeats", 1, "--warmup", 0, "--out", out)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 + 2 * 2 * 2 and all(row["status"] == "ok" for row in rows), rows
    assert all(row["rounds"] == "2" and len(row["round_medians_ms"].split()) == 2 for row in rows), rows
    floor = {row["mode"]: float(row["median_ms"]) for row in rows if row["method"] == "gemm"}
    for row in rows:
        assert abs(float(row["ratio_to_gemm"]) - float(row["median_ms"]) / floor[row["mode"]]) < 2e-3 * float(
            row["ratio_to_gemm"]), row
    bad = run_benchmark("topk_linear.py", "--device", "cpu", "--rounds", 0)
    assert bad.returncode == 2 and "--rounds" in bad.stderr, bad.stderr
    # The training-step methods: the training path and the composition time "full" fwd + bwd alone.
    out2 = tmp_path / "topk_linear_paths.csv"
    result = run_benchmark("topk_linear.py", "--device", "cpu", "--shape", "40,300,32", "--topk", 4, "--dtype",
                           "float32", "--rounds", 1, "--repeats", 1, "--warmup", 0, "--methods", "nitrobrew_training",
                           "nitrobrew_recompute", "composition", "--out", out2)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out2.open()))
    timed = sorted((row["method"], row["normalize"], row["mode"]) for row in rows if row["method"] != "gemm")
    assert timed == sorted([("nitrobrew_training", "full", "fwd_bwd"), ("composition", "full", "fwd_bwd")] +
                           [("nitrobrew_recompute", n, m) for n in ("full", "topk") for m in ("forward", "fwd_bwd")])
    assert all(row["status"] == "ok" for row in rows), rows


def test_vocab_parallel_benchmark_smoke(tmp_path):
    # benchmarks/vocab_parallel.py over gloo on the CPU: 1 and 2 ranks, every method and mode measured, the four
    # whole-vocabulary losses equal on 2 ranks (Megatron's within its bf16-rounded logits), the CSV written.
    import csv

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "vocab_parallel.csv"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vocab_parallel.py"), "--device", "cpu",
                             "--gpus", "1", "2", "--shape", "48,600,24,40", "--rounds", "1", "--repeats", "1",
                             "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * 2 + 2 * 5 and all(row["status"] == "ok" for row in rows), rows
    losses = {row["method"]: float(row["loss_value"]) for row in rows if row["gpus"] == "2"}
    assert abs(losses["allgather_weights"] - losses["nitrobrew"]) < 1e-5 * losses["nitrobrew"], losses
    assert abs(losses["nitrobrew_recompute"] - losses["nitrobrew"]) < 1e-5 * losses["nitrobrew"], losses
    assert abs(losses["megatron_logits"] - losses["nitrobrew"]) < 1e-2 * losses["nitrobrew"], losses


@pytest.mark.parametrize("teacher", ["whole", "fsdp2"])
def test_fsdp2_step_benchmark_smoke(tmp_path, teacher):
    # benchmarks/fsdp2_step.py over gloo on the CPU with tiny models: FSDP2 on 2 ranks, every method steps
    # (nitrobrew.hf, nitrobrew's two paths on the decoders called directly (a whole teacher only), and the
    # logits), and their losses agree (the logits method rounds its logits to bf16).
    import csv

    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "fsdp2_step.csv"
    methods = ["nitrobrew_hf", "logits"] + (["nitrobrew", "nitrobrew_training"] if teacher == "whole" else [])
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp2_step.py"), "--device", "cpu", "--tiny",
                             "--gpus", "2", "--warmup", "1", "--repeats", "1", "--teacher-layout", teacher,
                             "--methods", *methods, "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["method"]: row for row in csv.DictReader(out.open())}
    assert set(rows) == set(methods), rows
    assert all(r["status"] == "ok" for r in rows.values()), rows
    losses = {m: float(rows[m]["loss_mean_over_ranks"]) for m in methods}
    for m in methods:
        tolerance = 2e-2 if m == "logits" else 1e-3
        assert abs(losses[m] - losses["nitrobrew_hf"]) < tolerance * abs(losses["nitrobrew_hf"]), rows

def test_the_demo(tmp_path):
    # `make demo` (python -m nitrobrew) on a small problem: both methods agree, and it says what the fused path
    # wins on the CPU.
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "nitrobrew", "--device", "cpu", "--tokens", "64", "--vocab", "500",
                             "--d-student", "16", "--d-teacher", "24", "--repeats", "1"],
                            capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "-> match" in result.stdout and "GiB of extra peak memory against naive's" in result.stdout, result.stdout
    assert "On the CPU the fused path's gain is memory" in result.stdout
