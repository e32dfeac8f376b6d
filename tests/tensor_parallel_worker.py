"""One rank of a tensor-parallel run (``tests/test_tensor_parallel.py`` starts two with ``mlx.launch``).

Arguments: a model directory, a ``--kv-cache`` scheme, a window size (0: none), an output file,
and optionally ``quantized`` (keep MLX-quantized weights quantized, which the CPU would expand).
Loads the model (which ``Model.load`` shards over the group), computes every prompt position's
logits, 8 greedy tokens, and the tokens of two prompts generated together through batched
caches; rank 0 writes them, the group's size and the KV bytes of one rank and of all to the
output file (safetensors).
"""

import sys

import butter_core  # noqa: F401 - before mlx.core
import mlx.core as mx

from butter_core import LoadOptions, Window
from butter_core.distributed import total_bytes, world
from butter_core.loading.weights import WeightOptions
from butter_core.model import Model

directory, scheme, window, output = sys.argv[1:5]
weights = WeightOptions(dequantize=False) if sys.argv[5:] == ["quantized"] else None
model = Model.load(directory, LoadOptions(kv_cache=scheme, kv_eviction=Window(int(window), keep=2) if int(window) else None),
                   weights=weights)
prompt = model.encode_prompt("Once upon a time there was a tiny model that wrote short stories")
caches = model.engine.make_layer_caches()
logits = model.engine.forward(prompt, caches, all_logits=True)
mx.eval(logits)  # on every rank: its all-reduces need every rank
tokens = list(model.generate(prompt, max_tokens=8, stop_ids=()))
batch = model.generate_batch(model.engine.make_batched_caches(capacity_tokens=256, page_size=8))
ids = [batch.add(p, max_tokens=6, stop_ids=()) for p in (prompt, model.encode_prompt("def add(a, b):"))]
batched = {i: [] for i in ids}
for sequence_id, token in batch:
    batched[sequence_id].append(token)
rank_bytes = sum(cache.nbytes_live for cache in caches)
every = total_bytes(rank_bytes)
group = world()
if group.rank() == 0:
    mx.save_safetensors(output, {"logits": logits, "tokens": mx.array(tokens), "batched": mx.array([batched[i] for i in ids])},
                        metadata={"size": str(group.size()), "rank_bytes": str(rank_bytes), "all_bytes": str(every),
                                  "quantized_modules": str(sum("scales" in m for _, m in model.network.named_modules()))})
