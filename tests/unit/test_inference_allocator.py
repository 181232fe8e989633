"""The decode loop's malloc settings (inference/hf/allocator.py): a step's fresh tensors no longer
page-fault in again.

Measured in child processes (the settings are per process and cannot be undone): minor page
faults per call of the sampler on SmolLM2-sized logits (16 x 49,152), after a warm-up, with and
without ``keep_freed_memory``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "1":
    from prime_composer.inference.hf.allocator import keep_freed_memory
    assert keep_freed_memory()
from prime_composer.inference.hf.sampling import make_generator, sample_rows
torch.set_num_threads(1)
logits = torch.randn(16, 49152)
gens = [make_generator(i, 0, torch.device("cpu")) for i in range(16)]
for _ in range(3):
    sample_rows(logits, [1.0] * 16, [1.0] * 16, gens, 0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    sample_rows(logits, [1.0] * 16, [1.0] * 16, gens, 0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_call(keep: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "1" if keep else "0"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings are Linux-only")
def test_a_steps_tensors_reuse_the_heap_instead_of_faulting_in_again():
    # 16 x 49,152 float64 is 1,536 pages: without the settings every call faults them in again.
    without = _faults_per_call(keep=False)
    assert without > 1000
    # With the settings most calls fault nothing; now and then one call faults one buffer in again
    # (0 in most of 8 runs, at most 307 per call against ~3,000 without).
    assert _faults_per_call(keep=True) < without / 4
