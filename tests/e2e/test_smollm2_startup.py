"""What a warm start of the default model imports: the engine, with the shipped registry and
its contracts, built in a fresh process once the config and tokenizer caches hold the model,
never imports transformers (0.6-1.0 s of every start on 2 vCPUs, engine/loading/config_cache.py)
nor torch._dynamo (1.5-2.2 s on a 2-vCPU AVX2 EPYC: torch's Python meta kernels import it on
their first call, tests/engine/loading/test_build.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.loading.source import ModelSource, load_hf_config, load_tokenizer
from tests.e2e.conftest import SHIPPED_PREFIXES

pytestmark = pytest.mark.e2e


def test_a_warm_start_builds_the_engine_without_transformers(
    smollm2_source: ModelSource, tmp_path: Path
) -> None:
    load_hf_config(smollm2_source.path)  # what any earlier start left in the caches
    load_tokenizer(smollm2_source.path)
    probe = (
        "import sys\n"
        "from engine import EngineConfig, LLMEngine\n"
        f"engine = LLMEngine(EngineConfig(prefix_file={str(SHIPPED_PREFIXES)!r},\n"
        "                                 kv_cache_memory=256 << 20, max_model_len=2048))\n"
        "print(len(engine.registry.prefixes), engine.checker.grammars.vocab_size,\n"
        "      sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'),\n"
        "      'torch._dynamo' in sys.modules)\n"
        "engine.close()\n"  # its snapshot writer's thread, joined before exit
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The three shipped entries, a grammar compiler (built by the probe, as by a first
    # constrained request), no module of transformers, no torch._dynamo.
    assert done.stdout.split("\n")[0] == "3 49152 [] False"
