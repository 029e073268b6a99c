"""Hugging Face hub ids (issue 35, item 9): `--model org/name` and `load_pretrained("org/name")`
resolve through the Hugging Face cache. Nothing is downloaded here: every test builds its own
cache folder in the hub layout (models--org--name/{blobs, snapshots/<commit>, refs/main}) holding
a tiny checkpoint written by tests/hf_fixtures.py, runs with HF_HUB_OFFLINE=1 (or a faked
`snapshot_download` for the online paths) and with sockets refused."""
import hashlib
import json
import os
import shutil
import socket
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hf_fixtures  # noqa: E402  (tests/ is on sys.path: conftest.py)
import maskahead_jax as mj  # noqa: E402
from converters import load as L  # noqa: E402
from maskahead_jax import cli  # noqa: E402

REPO = "tiny-org/tiny-dllm"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Refuse every connection: a test that tries the network fails instead of downloading."""
    def refuse(*a, **k):
        raise AssertionError("a test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """An empty hub cache under tmp_path, offline; HF_HOME and the legacy variable cleared."""
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cache_model(cache, repo_id: str, src: str, commit: str = COMMIT) -> str:
    """Put the files of folder `src` into `cache` as huggingface_hub stores a download: content in
    blobs/<sha256>, snapshots/<commit>/<name> symlinks to them, refs/main holding the commit."""
    repo = os.path.join(str(cache), "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for name in sorted(os.listdir(src)):
        if os.path.lexists(os.path.join(snap, name)):
            continue
        data = open(os.path.join(src, name), "rb").read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    return snap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Fast-dLLM-v2-layout (qwen2 + bd_size) HF folder."""
    return hf_fixtures.qwen2(str(tmp_path_factory.mktemp("tiny") / "model")).path


def _same_params(a, b):
    import jax

    la, lb = jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)
    assert len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_hub_ids_and_cache_location(tmp_path, monkeypatch):
    assert L.is_hub_id("Efficient-Large-Model/Fast_dLLM_v2_7B") and L.is_hub_id("inclusionAI/LLaDA2.0-mini-preview")
    for not_id in ("gpt2", "/abs/path", "./rel/model", "a/b/c", "org/", "/name", "org/na--me", "org/..", "-x/y"):
        assert not L.is_hub_id(not_id), not_id
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert L.hub_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert L.hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert L.hub_cache_dir() == str(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert L.hub_cache_dir() == str(tmp_path / "c")
    for v, off in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", v)
        assert L.hub_offline() is off


def test_load_pretrained_hub_id_offline_from_cache(tiny, hub_env):
    snap = cache_model(hub_env, REPO, tiny)
    assert L.resolve_model_path(REPO) == snap == mj.api.model_folder(REPO)
    _same_params(mj.load_pretrained(REPO), mj.load_pretrained(tiny))
    assert L.read_config(REPO) == L.read_config(tiny)


def test_hf_home_is_respected(tiny, hub_env, tmp_path, monkeypatch):
    """No HF_HUB_CACHE: the cache is HF_HOME/hub."""
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snap = cache_model(tmp_path / "home" / "hub", REPO, tiny)
    assert mj.api.model_folder(REPO) == snap


def test_cli_runs_a_cached_hub_id_offline(tiny, hub_env, tmp_path, capsys):
    cache_model(hub_env, REPO, tiny)
    assert cli.main(["generate", "--ids", "5,6,7,8", "--model", REPO, "--max-new-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 4 and out["nfe"] > 0
    # `maskahead convert org/name DST` reads the cached snapshot too
    dst = tmp_path / "conv"
    assert cli.main(["convert", REPO, str(dst)]) == 0
    _same_params(mj.load_pretrained(str(dst)), mj.load_pretrained(tiny))


def test_a_local_path_wins_over_a_hub_id(tiny, hub_env, tmp_path, monkeypatch):
    """A folder that exists under the name is used as it is, cached snapshot or not."""
    cache_model(hub_env, REPO, tiny)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(cli.TESTBED, tmp_path / REPO)
    assert L.resolve_model_path(REPO) == REPO
    assert cli.model_path(REPO) == REPO
    assert mj.load_pretrained(REPO).config == L.read_config(cli.TESTBED)


def _one_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_not_cached_and_offline_is_one_line(hub_env, tmp_path, capsys):
    repo = "nobody/not-cached"
    with pytest.raises(L.HubError) as ex:
        mj.load_pretrained(repo)
    msg = str(ex.value)
    assert "\n" not in msg
    assert msg.startswith(f"model '{repo}' is not in the Hugging Face cache ({hub_env}) and the hub is offline "
                          f"(HF_HUB_OFFLINE is set): run `hf download {repo}`")
    assert "or pass a local folder" in msg
    for cmd in (["generate", "--ids", "5,6", "--model", repo],
                ["eval", "--suite", "--model", repo, "--out", str(tmp_path / "ev")],
                ["profile", "--model", repo]):
        assert cli.main(cmd) == 2
        assert _one_line(capsys) == f"maskahead {cmd[0]}: error: {msg}"
    assert not os.path.exists(tmp_path / "ev")
    assert cli.main(["convert", repo, str(tmp_path / "dst")]) == 2
    assert _one_line(capsys) == f"maskahead convert: error: {msg}"
    # not a hub id and not a folder: the plain error
    assert cli.main(["generate", "--ids", "5,6", "--model", str(tmp_path / "nope")]) == 2
    assert "model folder not found" in _one_line(capsys)
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        mj.load_pretrained(str(tmp_path / "nope"))


def test_online_paths(tiny, hub_env, monkeypatch, capsys):
    """With the hub reachable (faked: snapshot_download is replaced, sockets stay refused), a
    model that is not cached is downloaded into the cache (config, tokenizer and safetensors
    files, never code or duplicate torch weights), with a line on stderr; an unreachable hub, an
    unknown and a gated repository are one-line errors."""
    import huggingface_hub as hub
    from huggingface_hub import errors

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_download(repo_id, *, cache_dir=None, local_files_only=False, allow_patterns=None, **kw):
        calls.append(dict(repo_id=repo_id, cache_dir=cache_dir, local_files_only=local_files_only,
                          allow_patterns=allow_patterns))
        return cache_model(cache_dir, repo_id, tiny)

    monkeypatch.setattr(hub, "snapshot_download", fake_download)
    snap = L.resolve_model_path(REPO)
    assert os.path.isfile(os.path.join(snap, "model.safetensors"))
    (call,) = calls
    assert call["repo_id"] == REPO and call["cache_dir"] == str(hub_env) and not call["local_files_only"]
    pats = call["allow_patterns"]
    assert "*.safetensors" in pats and "*.json" in pats and not any(p.endswith((".py", ".bin")) for p in pats)
    assert "downloading tiny-org/tiny-dllm from the Hugging Face hub" in capsys.readouterr().err
    L.resolve_model_path(REPO)  # cached now: no download line
    assert "downloading" not in capsys.readouterr().err

    response = types.SimpleNamespace(headers={}, request=None, status_code=404)
    for exc, expect in [
        (errors.LocalEntryNotFoundError("connection refused"),
         "model 'other/model' is not in the Hugging Face cache ({}) and the hub is unreachable: run `hf download"),
        (errors.RepositoryNotFoundError("404", response=response),
         "no local folder other/model, and no model 'other/model' on the Hugging Face hub"),
        (errors.GatedRepoError("403", response=response),
         "model 'other/model' is gated on the Hugging Face hub: accept its terms"),
    ]:
        def failing(*a, exc=exc, **k):
            raise exc

        monkeypatch.setattr(hub, "snapshot_download", failing)
        assert cli.main(["generate", "--ids", "5,6", "--model", "other/model"]) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("maskahead: down")]
        assert len(err) == 1 and err[0].startswith("maskahead generate: error: " + expect.format(hub_env)), err


def test_eval_records_the_hub_id(tiny, hub_env, tmp_path, monkeypatch, capsys):
    """`maskahead eval --model org/name` runs from the cached snapshot (forwards faked) and names
    both the hub id and the snapshot folder in summary.json."""
    import importlib

    from maskahead_jax.engine.stats import GenerateOutput

    G = importlib.import_module("maskahead_jax.generate")
    snap = cache_model(hub_env, REPO, tiny)

    def fake(model, prompts, cfg, policy=None, **kw):
        b = len(prompts)
        st = dict(reduction_final=[1.0] * b, reduction_peak=[1.0] * b, kv_bytes_final=[1.0] * b,
                  kv_bytes_peak=[1.0] * b, dense_bytes_final=[1.0] * b, dense_bytes_peak=[1.0] * b,
                  nfe=[1] * b, nfe_batch=1, wall_s=0.01, evictions=0)
        return GenerateOutput(tokens=[[5] for _ in prompts], stats=st)

    monkeypatch.setattr(G, "generate", fake)
    out = tmp_path / "ev"
    assert cli.main(["eval", "--needle", "--lengths", "64", "--depths", "0.5", "--n", "1", "--policies", "dense",
                     "--model", REPO, "--out", str(out), "--no-progress", "--no-plots"]) == 0
    meta = json.load(open(out / "summary.json"))["meta"]
    assert meta["hub_id"] == REPO and meta["model"] == snap
