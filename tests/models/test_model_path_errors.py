"""Model names that cannot be loaded are a ModelPathError (a UserError: one `error:` line in the CLI) naming the
config key they came from; a hub id that is neither cached nor downloadable fails at once, not after retries."""
import socket
import ssl
import time
import urllib.error
import urllib.request

import pytest

from fleetrl.errors import UserError
from fleetrl.models import hf
from fleetrl.models.hf import ModelPathError, check_model_name, load_causal_lm, load_tokenizer
from fleetrl.models.sources import ModelSourceError


@pytest.mark.parametrize("name, key, match", [
    ("/tmp/fleetrl-no-such-model", "model.path", r"^model\.path='/tmp/fleetrl-no-such-model' does not exist"),
    ("gguf:/tmp/fleetrl-missing.gguf", "model.path",
     r"GGUF model model\.path='gguf:/tmp/fleetrl-missing\.gguf': no file at '/tmp/fleetrl-missing\.gguf'"),
    ("tiny:hidden=abc", "model.path", r"bad tiny model spec model\.path='tiny:hidden=abc': hidden='abc' is not a int"),
    ("tiny:width=3", "rewards.model.path", r"rewards\.model\.path='tiny:width=3': item 'width=3' is not key=value"),
    ("/tmp/fleetrl-no-such-tok", "model.tokenizer", r"^model\.tokenizer='/tmp/fleetrl-no-such-tok' does not exist"),
])
def test_check_names_the_key(name, key, match):
    with pytest.raises(ModelPathError, match=match) as err:
        check_model_name(name, key)
    assert isinstance(err.value, UserError) and isinstance(err.value, ValueError)  # old `except ValueError` still work


def test_loaders_pass_the_key_down():
    with pytest.raises(ModelPathError, match=r"^model\.tokenizer='\./nope' does not exist"):
        load_tokenizer("./nope", key="model.tokenizer")
    with pytest.raises(ModelPathError, match=r"bad tiny model spec model\.path='tiny:layers=x'"):
        load_causal_lm("tiny:layers=x", key="model.path")
    with pytest.raises(ModelPathError, match=r"^model path '/tmp/fleetrl-nope' does not exist"):  # no key given
        load_causal_lm("/tmp/fleetrl-nope")


def test_folder_without_model_names_the_key(tmp_path):
    with pytest.raises(ModelPathError, match=r"could not load a tokenizer from model\.tokenizer="):
        load_tokenizer(str(tmp_path), key="model.tokenizer")


def test_model_source_errors_are_user_errors():
    assert issubclass(ModelSourceError, UserError)


def test_uncached_hub_id_with_hub_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelPathError, match=r"model\.path='nope-org/nope-model' is not a local folder .* is not "
                                             r"cached locally .*HF_HUB_OFFLINE is set.*gguf:FILE\.gguf") as err:
        check_model_name("nope-org/nope-model", "model.path")
    assert time.monotonic() - start < 2
    assert "hf download nope-org/nope-model" in str(err.value)


def test_uncached_hub_id_with_hub_unreachable_fails_at_once(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hf, "_hub_reachable", lambda: False)
    with pytest.raises(ModelPathError, match=r"model\.tokenizer='nope-org/nope-model' .*not cached locally .*"
                                             r"cannot be reached from here"):
        load_tokenizer("nope-org/nope-model", key="model.tokenizer")


def test_unknown_hub_id_fails_within_seconds_online_or_not():
    """For real: this machine may or may not reach the hub; either way no 40 s of retries."""
    start = time.monotonic()
    with pytest.raises(ModelPathError, match=r"model\.path='nope-org/nope-model-fleetrl-test'"):
        load_causal_lm("nope-org/nope-model-fleetrl-test", key="model.path")
    assert time.monotonic() - start < 15


def _fake_cached_repo(cache, repo_id: str) -> None:
    """The HF cache layout: models--ORG--NAME/refs/main -> a commit; snapshots/COMMIT/ holds the files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")


def test_cached_hub_id_loads_from_the_cache_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    _fake_cached_repo(tmp_path, "org/cached")
    monkeypatch.setattr(hf, "_hub_reachable", lambda: False)
    # local_files_only: huggingface_hub then skips its update check and the retries that come with it
    assert hf._resolve("org/cached", key="model.path") == ("org/cached", {"local_files_only": True})
    monkeypatch.setattr(hf, "_hub_reachable", lambda: True)
    assert hf._resolve("org/cached", key="model.path") == ("org/cached", {})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "_hub_reachable", lambda: pytest.fail("offline: the hub must not be probed"))
    assert hf._resolve("org/cached", key="model.path") == ("org/cached", {})


def test_hub_probe_is_bounded(monkeypatch):
    monkeypatch.setattr(hf, "_HUB_PROBE_S", 0.2)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: time.sleep(5))  # a black-holed connection
    hf._hub_reachable.cache_clear()
    try:
        start = time.monotonic()
        assert hf._hub_reachable() is False
        assert time.monotonic() - start < 1
    finally:
        hf._hub_reachable.cache_clear()


@pytest.mark.parametrize("error, reachable", [
    (urllib.error.URLError(ssl.SSLCertVerificationError("self-signed certificate")), True),  # a server answered
    (urllib.error.URLError(ConnectionRefusedError(111, "refused")), False),
    (urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution")), False),
])
def test_only_a_failure_to_connect_counts_as_unreachable(monkeypatch, error, reachable):
    # urllib trusts fewer certificate stores than huggingface_hub's own client: a TLS failure is not "offline".
    def urlopen(*args, **kwargs):
        raise error

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    hf._hub_reachable.cache_clear()
    try:
        assert hf._hub_reachable() is reachable
    finally:
        hf._hub_reachable.cache_clear()
