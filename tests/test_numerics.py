"""rollwise asks MKL for its strict reproducible mode before MKL's first product, leaves a
user's own MKL_CBWR alone, and says when the mode could not be chosen (rollwise.numerics)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(),
                                reason="torch carries no MKL here")

PROBE = ("from rollwise.numerics import mkl_is_strict, reproducibility_note; "
         "print(mkl_is_strict(), reproducibility_note(2) is not None, reproducibility_note(1))")


def probe(before: str, env: dict | None = None) -> list[str]:
    code = f"{before}; import torch; torch.randn(64, 64) @ torch.randn(64, 64); {PROBE}"
    base = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**base, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_importing_rollwise_first_makes_mkl_strict():
    assert probe("import rollwise") == ["True", "False", "None"]
    assert probe("import torch; import rollwise") == ["True", "False", "None"]  # no op yet


def test_a_users_own_setting_is_kept_and_said():
    assert probe("import rollwise", {"MKL_CBWR": "AUTO"}) == ["False", "True", "None"]


def test_mkl_used_before_rollwise_is_said():
    before = "import torch; torch.randn(64, 64) @ torch.randn(64, 64); import rollwise"
    assert probe(before) == ["False", "True", "None"]
