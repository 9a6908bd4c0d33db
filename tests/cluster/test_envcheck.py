import pytest

from fleetrl.cluster.envcheck import EnvConflictError, resolve_device_env


def test_inherited_amd_visibility_is_dropped_on_workers():
    env = resolve_device_env({"FOO": "1"}, host_env={"ROCR_VISIBLE_DEVICES": "0,1", "PATH": "/bin"})
    assert env == {"FOO": "1", "FLEETRL_UNSET_ENV": "ROCR_VISIBLE_DEVICES"}


def test_explicit_conflict_is_an_error_naming_both():
    with pytest.raises(EnvConflictError, match=r"CUDA_VISIBLE_DEVICES='0'.*HIP_VISIBLE_DEVICES='1'"):
        resolve_device_env({"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "1"}, host_env={})


def test_agreeing_values_pass():
    env = {"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0"}
    assert resolve_device_env(env, host_env={}) == env
