"""The stall limit: first calls of a verb get cluster.first_call_stall_s while the worker answers its pings."""
from fleetrl.cluster.watchdog import Deadlines, stall_limit, stall_reason
from fleetrl.config.schema import ClusterConfig


def test_a_later_call_uses_stall_s():
    assert stall_limit(120.0, None, answered_ago_s=0.0) == 120.0


def test_a_first_call_of_an_answering_worker_gets_the_first_call_limit():
    # answered 3 s ago (<= stall_s 120): compiling, not frozen
    assert stall_limit(120.0, 900.0, answered_ago_s=3.0) == 900.0


def test_a_first_call_of_a_silent_worker_is_a_stall_after_stall_s():
    # no answer for 121 s > stall_s: a frozen process, whatever the call
    assert stall_limit(120.0, 900.0, answered_ago_s=121.0) == 120.0


def test_a_first_call_limit_below_stall_s_never_shortens_it():
    assert stall_limit(120.0, 30.0, answered_ago_s=0.0) == 120.0


def test_the_reason_names_the_setting_that_fired():
    assert stall_reason(130.4, 120.0, 120.0) == "made no progress for 130s (cluster.stall_s=120)"
    assert stall_reason(901.0, 900.0, 120.0) == ("made no progress for 901s "
                                                 "(cluster.first_call_stall_s=900: the verb's first call)")


def test_deadlines_know_a_verb_s_first_call():
    d = Deadlines(ClusterConfig())
    assert d.first("update_actor")
    d.record("update_actor", 2.0)
    assert not d.first("update_actor") and d.first("generate")
