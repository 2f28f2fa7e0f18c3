"""Building a model on the meta device (`on_meta`, every start's first step) stays off torch's
Python meta kernels: their first call imports torch._dynamo, which cost every Gemma 3 start
1.5-2.2 s on a 2-vCPU AVX2 EPYC (its norms' `1 + w`, computed on meta tensors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.loading.config_cache import entry_of
from tests.engine.executor.test_models import ARCHITECTURES

REPO = Path(__file__).resolve().parents[3]


def test_no_architecture_built_on_meta_imports_torch_dynamo(tmp_path: Path) -> None:
    # The configs as a warm start reads them (the config cache's entries); transformers'
    # models, which import torch._dynamo themselves, are built here, not in the probe.
    entries = {name: entry_of(make().config, name) for name, make in ARCHITECTURES.items()}
    entries_file = tmp_path / "entries.json"
    entries_file.write_text(json.dumps(entries))
    probe = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from engine.loading.build import on_meta\n"
        "from engine.loading.config_cache import rebuild\n"
        "seen = {'imports': 'torch._dynamo' in sys.modules}\n"
        f"for name, entry in json.loads(Path({str(entries_file)!r}).read_text()).items():\n"
        "    on_meta(rebuild(entry, Path('.')), 64, torch.float32)\n"
        "    seen[name] = 'torch._dynamo' in sys.modules\n"
        "print(json.dumps(seen))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().split("\n")[-1])
    assert seen == {"imports": False, **{name: False for name in ARCHITECTURES}}
