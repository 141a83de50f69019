"""Call-site attribution skips the wrappers torch puts around c10d functions."""

from __future__ import annotations

import torch.distributed as dist

from moedoctor.recorder import callsite


def test_deprecation_wrappers_around_c10d_functions_are_not_call_sites():
    # torch decorates reduce_scatter_tensor / all_gather_into_tensor with typing_extensions.deprecated:
    # the wrapper's frame (typing_extensions.py) was every such collective's "call site".
    for fn in (dist.reduce_scatter_tensor, dist.all_gather_into_tensor):
        chain = []
        while fn is not None:
            chain.append(fn.__code__)
            fn = getattr(fn, "__wrapped__", None)
        assert len(chain) >= 2
        for code in chain:
            assert callsite._flags(code) & callsite.INTERNAL, code.co_filename


def test_the_jobs_own_code_is_a_call_site():
    assert not callsite._flags(test_the_jobs_own_code_is_a_call_site.__code__) & callsite.INTERNAL
