import threading
import time

import pytest

from fleetrl.envs import base
from fleetrl.envs.base import (
    EnvCaller,
    EnvError,
    SingleTurnEnv,
    StepResult,
    env_factory,
)
from fleetrl.envs.tool_env import ToolEnv
from fleetrl.rewards.errors import RewardError

USER_ENV = '''
from fleetrl.envs.base import StepResult

class Counter:
    """Ends after `limit` steps; its reward is the number of steps."""
    def __init__(self, limit=2):
        self.limit, self.steps = limit, 0
    def reset(self, sample):
        return None
    def step(self, action):
        self.steps += 1
        return StepResult("again", float(self.steps), self.steps >= self.limit)

NOT_AN_ENV = 3
'''


def test_registered_names_and_file_specs(tmp_path):
    assert isinstance(env_factory("tools", tools=["calc"])({}), ToolEnv)
    path = tmp_path / "my_env.py"
    path.write_text(USER_ENV)
    make = env_factory(f"{path}:Counter", limit=3)
    first, second = make({}), make({})
    assert first is not second  # one instance per episode
    first.step("x")
    assert (first.steps, second.steps) == (1, 0)  # episode state is not shared


def test_bad_specs_fail_at_configuration_time(tmp_path):
    with pytest.raises(EnvError, match="unknown environment 'nope'; use a registered name"):
        env_factory("nope")
    with pytest.raises(EnvError, match="does not exist"):
        env_factory(f"{tmp_path}/missing.py:Env")
    path = tmp_path / "my_env.py"
    path.write_text(USER_ENV)
    with pytest.raises(EnvError, match="has no callable 'Nope'; callables there: .*'Counter'"):
        env_factory(f"{path}:Nope")
    with pytest.raises(EnvError, match="cannot construct it with {'size': 1}"):
        env_factory(f"{path}:Counter", size=1)
    with pytest.raises(EnvError, match="unknown tools \\['search'\\]"):
        env_factory("tools", tools=["search"])


def test_caller_turns_exceptions_and_timeouts_into_outcomes():
    def boom():
        raise KeyError("k")

    start = time.monotonic()
    outcomes = EnvCaller(timeout_s=0.3).call_all([lambda: 5, boom, lambda: time.sleep(5)])
    assert time.monotonic() - start < 1.5  # the sleeping call is abandoned at its deadline
    assert outcomes[0].value == 5 and outcomes[0].error is None
    assert outcomes[1].error == "KeyError: 'k'" and not outcomes[1].timed_out
    assert outcomes[2].timed_out and "0.3 s deadline" in outcomes[2].error


def test_caller_reuses_threads_and_a_hung_call_never_delays_later_ones():
    caller = EnvCaller(timeout_s=0.3)
    caller.call_all([lambda: 0] * 8)  # the pool now holds >= 8 idle workers (other tests' workers too)
    # A worker counts itself idle just after its result is handed back: wait for that rather than sleep a fixed
    # time (a worker not yet counted idle gets a new thread started beside it).
    deadline = time.monotonic() + 10
    while base._POOL._idle < 8:
        assert time.monotonic() < deadline, f"only {base._POOL._idle} pool workers idle after their calls returned"
        time.sleep(0.01)
    before = threading.active_count()
    assert [o.value for o in caller.call_all([lambda i=i: i for i in range(8)])] == list(range(8))
    assert threading.active_count() == before  # 8 calls on 8 idle workers: no new thread
    release = threading.Event()
    hung = caller.call_all([release.wait])  # abandoned at 0.3 s; its worker stays busy until released
    assert hung[0].timed_out
    # The hung worker is not counted idle, so each of these starts at once on another worker and ends well
    # within the 0.3 s deadline (a task queued behind the hung one would time out).
    later = caller.call_all([lambda: time.sleep(0.05) or "ok"] * 8)
    assert [o.value for o in later] == ["ok"] * 8
    release.set()


def test_single_turn_env_is_a_reward_function_as_one_step():
    env = SingleTurnEnv(scorer="gsm8k")
    env.reset({"ground_truth": "72", "extra_info": {}})
    assert env.step("so the answer is #### 72") == StepResult(None, 1.0, True)
    with pytest.raises(RewardError, match="unknown reward scorer 'nope'"):
        SingleTurnEnv(scorer="nope")
