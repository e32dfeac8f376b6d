"""Tensor parallelism on the CPU: two processes of a ring group (``mlx.launch``) against one process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

from butter_core import LoadOptions, Window
from butter_core.distributed import shard_network, world
from butter_core.loading.weights import WeightOptions
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.testing.tiny_models import TinySpec, write_tiny_model

WORKER = Path(__file__).parent / "tensor_parallel_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
TOLERANCE = 1e-4
"""Relative to the largest logit: the all-reduces sum the ranks' partial products in another order."""


def _free_ports(count: int) -> int:
    """A port ``p`` with ``p .. p + count - 1`` all free now (the ring backend listens on one per rank)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def launch(ranks: int, *command: str) -> subprocess.CompletedProcess:
    """``command`` on ``ranks`` processes of a ring group on loopback (``mlx.launch``). Free ports can be
    taken between the check and the launch: a launch whose ring could not bind is tried again."""
    for _ in range(3):
        argv = [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--starting-port", str(_free_ports(ranks)), "--",
                *command]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if "Couldn't bind socket" not in done.stdout + done.stderr:
            return done
    return done


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tensor-parallel"), TinySpec(family="qwen3"))


@pytest.mark.parametrize("family, scheme, window", [("qwen3", "raw", 0), ("qwen3", "affine8g32", 0), ("qwen3", "aura4v4", 0),
                                                    ("qwen3", "raw", 12), ("mamba2", "raw", 0), ("nemotron_h", "raw", 0),
                                                    ("nemotron_h", "aura4v4", 0), ("qwen3_next", "raw", 0),
                                                    ("qwen3_next", "aura4v4", 0), ("granitemoehybrid", "raw", 0),
                                                    ("granitemoehybrid", "aura4v4", 0)])  # fmt: skip
def test_two_ranks_give_one_process_tokens_and_logits(model_dir, family_model, tmp_path, family, scheme, window):
    """Each rank holds half the heads (Mamba2: half the heads and groups; Nemotron-H's and Qwen3-Next's
    MoE: half each expert's columns; Qwen3-Next's gated delta: half the key and value heads; Granite
    4.0-H's one Mamba2 group whole on each rank, its gated norm summed across them), and half
    the cache bytes; the
    ranks' logits are one process's, and so are their greedy tokens, alone and through batched caches,
    under a window too."""
    if scheme.rstrip("0123456789vg") not in get_plugin_host().schemes:
        pytest.skip(f"needs the {scheme} scheme")
    if family != "qwen3":
        if "ssm" not in get_plugin_host().schemes:
            pytest.skip("needs butter-ssm")
        model_dir = family_model(family)
    assert_ranks_give_one_process(model_dir, tmp_path, family, scheme, window)


def assert_ranks_give_one_process(model_dir, tmp_path, family, scheme, window, quantized=False):
    """Two ranks' logits, greedy tokens (alone and batched) and cache bytes against one process's."""
    output = tmp_path / "ranks.safetensors"
    done = launch(2, sys.executable, str(WORKER), str(model_dir), scheme, str(window), str(output),
                  *(["quantized"] if quantized else []))  # fmt: skip
    assert done.returncode == 0 and output.exists(), done.stdout + done.stderr  # mlx.launch exits 0 when a rank fails
    ranks, meta = mx.load(str(output), return_metadata=True)
    model = Model.load(str(model_dir), LoadOptions(kv_cache=scheme, kv_eviction=Window(window, keep=2) if window else None),
                       weights=WeightOptions(dequantize=False) if quantized else None)  # fmt: skip
    quantized_modules = sum("scales" in m for _, m in model.network.named_modules())
    assert (quantized_modules > 0) == quantized and int(meta["quantized_modules"]) == quantized_modules
    prompt = model.encode_prompt("Once upon a time there was a tiny model that wrote short stories")
    caches = model.engine.make_layer_caches()
    logits = model.engine.forward(prompt, caches, all_logits=True)
    assert meta["size"] == "2"
    assert (mx.abs(ranks["logits"] - logits).max() / mx.abs(logits).max()).item() < TOLERANCE
    assert ranks["tokens"].tolist() == list(model.generate(prompt, max_tokens=8, stop_ids=()))
    second = model.encode_prompt("def add(a, b):")
    assert ranks["batched"].tolist() == [list(model.generate(p, max_tokens=6, stop_ids=())) for p in (prompt, second)]
    one = sum(cache.nbytes_live for cache in caches)
    # each rank holds half the KV heads and states; what is whole on every rank counts once per rank: Qwen3-Next's
    # one KV head, Granite's one Mamba2 group's B/C convolution inputs, aura's table of recent rows
    bound = {"qwen3_next": 2, "granitemoehybrid": 1.1}.get(family, 1.03)
    assert int(meta["rank_bytes"]) * 2 == int(meta["all_bytes"]) and one <= int(meta["all_bytes"]) <= bound * one


def test_a_group_of_one_changes_nothing(model_dir):
    assert world().size() == 1
    model = Model.load(str(model_dir))
    shard_network(model.network, world())
    assert model.network.args.num_key_value_heads == model.network.layers[0].self_attn.n_kv_heads == 2
    assert model.network.shard == (0, 1) and model.engine.layer_specs()[0].shard == (0, 1)


@pytest.mark.usefixtures("raw_scheme")
def test_butter_generate_under_mlx_launch_prints_one_answer_and_all_ranks_bytes(model_dir, tmp_path):
    """``mlx.launch -n 2 -- butter generate``: rank 0 prints the one-process text; the summary adds all
    ranks' KV bytes. With ``--prompt-cache`` each rank keeps its own file, and a second run reuses them."""
    argv = ["-m", str(model_dir), "-p", "Once upon a time", "--max-tokens", "8", "--kv-cache", "raw"]
    butter = [sys.executable, "-c", "import sys; from butter_core.cli import main; sys.exit(main())", "generate"]
    alone = subprocess.run([*butter, *argv], capture_output=True, text=True, timeout=120)
    cache = tmp_path / "prompt.safetensors"
    runs = []
    for _ in range(2):
        runs.append(launch(2, *butter, *argv, "--prompt-cache", str(cache)))
    for done in runs:
        assert alone.returncode == done.returncode == 0, done.stdout + done.stderr
        assert done.stdout == alone.stdout
        assert "tensor parallel: 2 ranks" in done.stderr and done.stderr.count("decode:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompt.safetensors.rank0of2", "prompt.safetensors.rank1of2"]
    assert "0 of" in runs[0].stderr and "after" not in runs[0].stderr.split("decode:")[0]
    assert " held" in runs[1].stderr


def quantized_granite(family_model, directory: Path, intermediate: int) -> Path:
    """The tiny Granite 4.0-H checkpoint with its experts' and shared MLP's intermediate size set to
    ``intermediate`` (new random weights there) and every projection but the router MLX-quantized
    (4 bits, groups of 32), as an mlx-lm conversion stores them."""
    source = family_model("granitemoehybrid")
    config = json.loads((source / "config.json").read_text())
    config |= {"intermediate_size": intermediate, "shared_intermediate_size": intermediate,
               "quantization": {"group_size": 32, "bits": 4}}  # fmt: skip
    tensors = mx.load(str(source / "model.safetensors"))
    resized = {"block_sparse_moe.input_linear.weight": lambda s: (s[0], 2 * intermediate, s[2]),
               "block_sparse_moe.output_linear.weight": lambda s: (s[0], s[1], intermediate),
               "shared_mlp.input_linear.weight": lambda s: (2 * intermediate, s[1]),
               "shared_mlp.output_linear.weight": lambda s: (s[0], intermediate)}  # fmt: skip
    stored = {}
    for index, (name, tensor) in enumerate(sorted(tensors.items())):
        for suffix, shape in resized.items():
            if name.endswith(suffix):
                new = shape(tensor.shape)
                tensor = mx.random.normal(new, key=mx.random.key(index)) / new[-1] ** 0.5
        if name.endswith(("proj.weight", "_linear.weight")):
            stored[name], stored[name[: -len("weight")] + "scales"], stored[name[: -len("weight")] + "biases"] = (
                mx.quantize(tensor, group_size=32, bits=4))  # fmt: skip
        else:
            stored[name] = tensor
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), stored, metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((source / name).read_bytes())
    return directory


@pytest.mark.parametrize("scheme", ["raw", "aura4v4"])
def test_two_ranks_shard_mlx_quantized_weights(family_model, tmp_path, scheme):
    """MLX-quantized experts (rows of gate and up, whole groups of down's columns), the one-group Mamba2
    input projection (rows picked) and every other projection: one process's logits and tokens."""
    if scheme.rstrip("0123456789v") not in get_plugin_host().schemes or "ssm" not in get_plugin_host().schemes:
        pytest.skip(f"needs the {scheme} scheme and butter-ssm")
    directory = quantized_granite(family_model, tmp_path / "granite-q4", intermediate=64)
    assert_ranks_give_one_process(directory, tmp_path, "granitemoehybrid", scheme, 0, quantized=True)


@pytest.mark.usefixtures("raw_scheme")
def test_quantized_columns_that_are_not_whole_groups_per_rank_are_refused(family_model, tmp_path):
    if "ssm" not in get_plugin_host().schemes:
        pytest.skip("needs butter-ssm")
    directory = quantized_granite(family_model, tmp_path / "granite-q4", intermediate=32)
    done = launch(2, sys.executable, str(WORKER), str(directory), "raw", "0", str(tmp_path / "out.safetensors"), "quantized")
    assert ("tensor parallelism over 2 processes splits down_proj's input columns by whole quantization groups, and its "
            "1 group(s) of 32 do not divide by 2") in done.stderr, done.stderr


@pytest.mark.usefixtures("raw_scheme")
def test_heads_that_do_not_divide_among_the_ranks_are_refused_naming_them(model_dir):
    butter = [sys.executable, "-c", "import sys; from butter_core.cli import main; sys.exit(main())", "generate"]
    done = launch(3, *butter, "-m", str(model_dir), "-p", "Hi", "--max-tokens", "2")
    assert "tensor parallelism over 3 processes needs num_attention_heads (4) divisible by 3" in done.stderr, done.stderr


@pytest.mark.usefixtures("raw_scheme")
def test_butter_inspect_under_mlx_launch_reports_each_rank_and_all(model_dir):
    butter = [sys.executable, "-c", "import sys; from butter_core.cli import main; sys.exit(main())", "inspect"]
    done = launch(2, *butter, "-m", str(model_dir), "--max-context", "256")
    assert "tensor parallel: rank 0 of 2" in done.stdout and "tensor parallel: rank 1 of 2" in done.stdout, done.stderr
    assert "K/V [1, 1, 256, 32]" in done.stdout  # each rank: one of the two KV heads


@pytest.mark.usefixtures("raw_scheme")
def test_butter_serve_under_mlx_launch_answers_as_one_process_does(model_dir):
    """``mlx.launch -n 2 -- butter serve``: rank 0 answers the ``openai`` client while rank 1 steps with
    it; greedy replies to requests running together are one process's, a sampled request without a
    seed completes (the ranks share a drawn seed), and Ctrl-C stops both ranks."""
    openai = pytest.importorskip("openai")
    port = _free_ports(1)
    butter = [sys.executable, "-c", "import sys; from butter_core.cli import main; sys.exit(main())", "serve"]
    argv = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(_free_ports(2)), "--", *butter,
            "-m", str(model_dir), "--port", str(port), "--kv-cache", "raw", "--kv-memory", "4000000"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    model = Model.load(str(model_dir), LoadOptions(kv_cache="raw"))
    questions = ["What is the capital of France?", "Name a colour.", "Count to three."]
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, process.communicate()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)

        def ask(question, **sampling):
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                   max_tokens=8, **sampling)  # fmt: skip
            return reply.choices[0].message.content, reply.choices[0].finish_reason

        with ThreadPoolExecutor(len(questions)) as pool:
            replies = list(pool.map(lambda q: ask(q, temperature=0), questions))
        for question, (text, _) in zip(questions, replies):
            prompt = model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": question}]),
                                            add_special_tokens=False)  # fmt: skip
            assert text == model.tokenizer.decode(list(model.generate(prompt, max_tokens=8)))
        text, finish = ask(questions[0], temperature=0.9)
        assert finish in ("stop", "length")
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the launcher and both ranks
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    assert "tensor parallel over 2 ranks" in err and "butter_core" not in err, err  # mlx.launch prints its own Ctrl-C
