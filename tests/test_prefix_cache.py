"""The prefix cache of continuous batching: kept prompts in each scheme's encoded form, reused by later ones."""

from __future__ import annotations

import mlx.core as mx
import pytest

from butter_core import ConfigError, Window
from butter_core.cache import ATTENTION
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.prefix_cache import PrefixCache
from butter_core.testing.fixtures import example_model
from butter_core.testing.tiny_models import TinySpec, write_tiny_model

SCHEMES = sorted(name for name, r in get_plugin_host().schemes.items() if ATTENTION in r.scheme.layer_types)
TEXT = "Once upon a time there was a tiny model that wrote short stories about a fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("prefix-cache"), TinySpec(family="qwen3"))


def _one_by_one(model: Model, prompts: list[list[int]], prefix: PrefixCache, max_tokens: int = 6):
    """Each prompt generated after the previous one has ended, through one batch over ``prefix``: each
    one's tokens and the prompt tokens it took from the cache."""
    caches = model.engine.make_batched_caches(capacity_tokens=512, page_size=8)
    batch = model.generate_batch(caches, prefill_chunk=16, prefix_cache=prefix)
    tokens, cached = [], []
    for prompt in prompts:
        sequence_id = batch.add(prompt, max_tokens=max_tokens, stop_ids=())
        tokens.append([t for s, t in batch if s == sequence_id])
        cached.append(batch.cached_tokens[sequence_id])
    assert caches.free_pages == caches.num_pages
    return tokens, cached


def _prompts(model: Model) -> list[list[int]]:
    base = model.encode_prompt(TEXT)
    return [base, base + model.encode_prompt(" and a dog"), base[:20] + model.encode_prompt(" which"), base]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prompts_reuse_kept_prefixes_and_generate_what_they_generate_alone(model_dir, scheme):
    """A longer prompt reuses a kept one whole, a prompt that parts from a kept one after 20 tokens
    reuses those 20 (cut from the kept snapshot), a repeated prompt all but its last token; each
    generates the tokens it generates alone."""
    model = example_model(str(model_dir), scheme)
    prompts = _prompts(model)
    alone = [list(model.generate(p, max_tokens=6, stop_ids=())) for p in prompts]
    prefix = PrefixCache(10**8)
    tokens, cached = _one_by_one(model, prompts, prefix)
    assert cached == [0, len(prompts[0]), 20, len(prompts[0]) - 1]
    assert tokens == alone
    assert prefix.hits == 3 and prefix.misses == 1
    # the first prompt's snapshot is held within the second's, which it was dropped for
    assert len(prefix) == 2 and prefix.nbytes == sum(s.nbytes for s in prefix._entries.values())


@pytest.mark.usefixtures("raw_scheme")
@pytest.mark.parametrize("case", ["raw under a window", "aura under a window", "mamba2", "qwen3_next"])
def test_state_held_only_whole_is_reused_only_by_prompts_that_extend_it(model_dir, family_model, case):
    """Under a window of 12 the 44-token prompt has wrapped its ring, and a recurrent state holds every
    position it has read: a kept snapshot then holds its positions only all together, so only the
    prompt that extends it reuses it."""
    scheme, _, _ = case.partition(" ")
    if case in ("mamba2", "qwen3_next"):
        if "ssm" not in get_plugin_host().schemes:
            pytest.skip("needs butter-ssm")
        model = Model.load(str(family_model(case)))
    elif scheme not in SCHEMES:
        pytest.skip(f"needs {scheme}")
    else:
        model = example_model(str(model_dir), scheme, Window(12, keep=2))
    prompts = _prompts(model)
    alone = [list(model.generate(p, max_tokens=6, stop_ids=())) for p in prompts]
    tokens, cached = _one_by_one(model, prompts, PrefixCache(10**8))
    assert cached == [0, len(prompts[0]), 0, 0]
    assert tokens == alone


@pytest.mark.usefixtures("raw_scheme")
def test_the_byte_budget_evicts_the_least_recently_used(model_dir):
    model = example_model(str(model_dir), "raw")
    caches = model.engine.make_batched_caches(capacity_tokens=512, page_size=8)
    snapshots = {}
    for text in ("alpha beta gamma", "one two three four", "red green blue"):
        prompt = model.encode_prompt(text)
        handle = caches.open()
        caches.reserve(handle, len(prompt))
        mx.eval(model.engine.run_batched(mx.array(prompt, dtype=mx.uint32)[None], caches, [handle]))
        snapshots[tuple(prompt)] = caches.export_sequence(handle)
        caches.release(handle)
    (a, sa), (b, sb), (c, sc) = snapshots.items()
    prefix = PrefixCache(sa.nbytes + sb.nbytes + sc.nbytes - 1)
    prefix.insert(a, sa)
    prefix.insert(b, sb)
    assert prefix.lookup(list(a) + [9]).positions == len(a)  # a is now the most recently used
    prefix.insert(c, sc)
    assert a in prefix and b not in prefix and c in prefix
    assert prefix.nbytes == sa.nbytes + sc.nbytes
    tiny = PrefixCache(sa.nbytes - 1)
    tiny.insert(a, sa)
    assert len(tiny) == 0 and tiny.nbytes == 0
    with pytest.raises(ConfigError, match="max_bytes"):
        PrefixCache(0)
    with pytest.raises(ConfigError, match="kept for a prompt of"):
        prefix.insert(list(a) + [1], sa)


@pytest.mark.usefixtures("raw_scheme")
def test_import_is_refused_where_it_would_not_be_exact(model_dir):
    model = example_model(str(model_dir), "raw", Window(12, keep=2))
    caches = model.engine.make_batched_caches(capacity_tokens=512, page_size=8)
    prompt = model.encode_prompt(TEXT)
    handle = caches.open()
    caches.reserve(handle, len(prompt))
    mx.eval(model.engine.run_batched(mx.array(prompt, dtype=mx.uint32)[None], caches, [handle]))
    snapshot = caches.export_sequence(handle)
    assert not snapshot.truncatable
    other = caches.open()
    caches.reserve(other, len(prompt))
    with pytest.raises(ConfigError, match="cannot give its first 20"):
        caches.import_sequence(other, snapshot, 20)
    with pytest.raises(ConfigError, match="import into an empty one"):
        caches.import_sequence(handle, snapshot, len(prompt))
    caches.import_sequence(other, snapshot, len(prompt))
    assert caches.length(other) == len(prompt)


@pytest.mark.usefixtures("raw_scheme")
def test_a_request_arriving_with_another_that_shares_its_prompt_waits_and_reuses_it(model_dir):
    """Added together, the second of two prompts sharing most of their tokens is admitted once the first
    has read its prompt, and prefills only the rest."""
    model = example_model(str(model_dir), "raw")
    base = model.encode_prompt(TEXT)
    prompts = [base + model.encode_prompt(" and a dog"), base + model.encode_prompt(" and a cat"),
               model.encode_prompt("def add(a, b):")]  # fmt: skip
    alone = [list(model.generate(p, max_tokens=6, stop_ids=())) for p in prompts]
    caches = model.engine.make_batched_caches(capacity_tokens=512, page_size=8)
    batch = model.generate_batch(caches, prefill_chunk=16, prefix_cache=PrefixCache(10**8))
    ids = [batch.add(p, max_tokens=6, stop_ids=()) for p in prompts[:2]]
    batch.step()
    assert batch.running == 1  # the second waits: the first is reading the prompt it shares
    ids.append(batch.add(prompts[2], max_tokens=6, stop_ids=()))
    got: dict[int, list[int]] = {i: [] for i in ids}
    for sequence_id, token in batch:
        got[sequence_id].append(token)
    assert [got[i] for i in ids] == alone
    shared = len(base) + len(model.encode_prompt(" and a"))
    assert batch.cached_tokens[ids[1]] >= len(base) and batch.cached_tokens[ids[1]] <= shared
