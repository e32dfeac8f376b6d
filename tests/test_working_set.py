"""``PrefillPipeline`` (``butter_core.working_set``): what the compressed schemes' caches share so that
on a GPU few layers' decoded K/V are alive at once in a prefill."""

import mlx.core as mx
import pytest

from butter_core.kernels import standing_in_for_gpu
from butter_core.plugin_api import PrefillPipeline


def test_prefill_pipeline_waits_for_all_but_the_newest():
    pipeline = PrefillPipeline(depth=1)
    outs = [mx.ones((1, 2, 4, 8)) * i for i in range(3)]
    with standing_in_for_gpu():
        for out in outs:
            pipeline.submit(out)
    assert len(pipeline._in_flight) == 1 and pipeline._in_flight[0] is outs[-1]


@pytest.mark.skipif(mx.default_device() == mx.gpu, reason="where the default device is a GPU it submits")
def test_prefill_pipeline_holds_nothing_on_the_cpu():
    pipeline = PrefillPipeline()
    pipeline.submit(mx.ones((1, 2, 4, 8)))
    assert not pipeline._in_flight


def test_prefill_pipeline_lets_a_single_tokens_output_pass():
    pipeline = PrefillPipeline()
    with standing_in_for_gpu():
        pipeline.submit(mx.ones((1, 2, 1, 8)))
    assert not pipeline._in_flight


def test_prefill_pipeline_depth_is_not_negative():
    with pytest.raises(ValueError, match="depth must be >= 0"):
        PrefillPipeline(depth=-1)
