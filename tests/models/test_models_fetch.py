"""Where models come from: a local folder, a catalog name fetched by `rollwise models get`, or a
hub id through transformers' cache (offline here); and the GGUF conversion's own checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_model import build_chat_model
from transformers import AutoModelForCausalLM

from rollwise import models
from rollwise.models import fetch


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_MODELS", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_catalog_name_loads_its_fetched_folder(model_cache, tmp_path):
    name = next(iter(fetch.CATALOG))
    with pytest.raises(FileNotFoundError, match=f"rollwise models get {name}"):
        models.resolve_path(name)
    folder = build_chat_model(model_cache / name)
    (folder / "rollwise-model.json").write_text("{}")  # what get() writes last
    model, tok = models.load_model(name)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([tok("What is 12 + 7?")["input_ids"]])
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_an_unknown_catalog_name_is_refused_with_the_catalog(model_cache, capsys):
    from rollwise.cli import main
    assert main(["models", "get", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    with pytest.raises(fetch.FetchError, match="the catalog has"):
        fetch.get("no-such-model")


def test_a_missing_local_folder_says_what_was_tried(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        models.resolve_path(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.resolve_path(tmp_path / "empty")


def _hub_cache(root: Path, repo: str) -> Path:
    """transformers' cache layout for `repo` at one commit: what a download leaves behind."""
    commit = "0" * 40
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    build_chat_model(repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return repo_dir / "snapshots" / commit


HUB_PROBE = """
import json, sys, torch
from rollwise import models
from rollwise.config import load_config
from rollwise.loop.run import preflight, Inputs
try:
    preflight(load_config(None, ["model.path=" + sys.argv[1]]), Inputs())
    model, tok = models.load_model(sys.argv[1])
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
else:
    ids = torch.tensor([tok("What is 12 + 7?")["input_ids"]])
    print(json.dumps({"logits": model(ids).logits[0, -1, :5].tolist()}))
"""


def test_a_hub_id_loads_from_transformers_cache_offline(tmp_path):
    """model.path=org/name goes to transformers as it is: with HF_HUB_OFFLINE=1 a cached
    repository loads (the same logits as its folder), a missing one is a clear error."""
    snapshot = _hub_cache(tmp_path / "hub", "someorg/tiny-chat")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "home")}

    def probe(repo):
        out = subprocess.run([sys.executable, "-c", HUB_PROBE, repo], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])
    got = probe("someorg/tiny-chat")
    model, tok = models.load_model(snapshot)
    ids = torch.tensor([tok("What is 12 + 7?")["input_ids"]])
    assert got["logits"] == pytest.approx(model(ids).logits[0, -1, :5].tolist(), abs=1e-6)
    missing = probe("someorg/not-cached")["error"]
    assert "FileNotFoundError" in missing and "HF_HUB_OFFLINE is set" in missing


def test_plain_copy_drops_the_quantization_config_and_keeps_every_weight(tmp_path):
    """What convert() does to a GGUF-loaded model, on a small one marked as quantized: the
    copy saves (a quantized model refuses to) with equal logits; a changed weight is caught."""
    model = AutoModelForCausalLM.from_pretrained(build_chat_model(tmp_path / "src"))
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    plain = fetch.plain_copy(model)
    assert getattr(plain.config, "quantization_config", None) is None
    tok = models.load_tokenizer(tmp_path / "src")
    plain.save_pretrained(tmp_path / "out")
    assert fetch.logits_gap(model, tmp_path / "out", tok) == 0.0
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 0.5
    assert fetch.logits_gap(model, tmp_path / "out", tok) > 0.0


def test_get_without_the_converter_packages_names_the_extra(model_cache, monkeypatch):
    monkeypatch.setattr(fetch, "_absent", lambda module: module == "gguf")
    with pytest.raises(fetch.FetchError, match=r"pip install -e '\.\[models\]'"):
        fetch.get(next(iter(fetch.CATALOG)))
    assert not model_cache.exists() or not any(model_cache.iterdir())


def test_models_list_shows_where_each_model_is(model_cache, capsys):
    from rollwise.cli import main
    assert main(["models", "list"]) == 0
    assert "not fetched: rollwise models get" in capsys.readouterr().out


def test_a_model_path_that_is_nowhere_stops_before_any_work(tmp_path, capsys):
    from rollwise.cli import main
    code = main(["train", f"run.root={tmp_path}", f"model.path={tmp_path}/nothing-here"])
    assert code == 2 and "no such model folder" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
