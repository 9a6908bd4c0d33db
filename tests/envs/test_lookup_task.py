from fleetrl.data.synthetic import SYNTHETIC_TASKS
from fleetrl.envs.base import env_factory
from fleetrl.models.hf import load_tokenizer


def test_lookup_rows_need_the_tool_and_fit_the_tiny_vocabulary():
    import fleetrl.data.tasks  # noqa: F401  (registers the built-in synthetic tasks)

    rows = SYNTHETIC_TASKS["lookup"](n=50, keys=4, split="train", seed=1)
    val = SYNTHETIC_TASKS["lookup"](n=50, keys=4, split="val", seed=1)
    tokenizer = load_tokenizer("tiny:")
    for row in rows + val:
        key = row["prompt"][0]["content"].split()[1]
        table = row["extra_info"]["lookup"]
        assert len(table) == 4 and row["reward_model"]["ground_truth"] == table[key] == table[row["extra_info"]["key"]]
        assert table[key] not in row["prompt"][0]["content"]  # the value is only in the tool's table
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert tokenizer.unk_token_id not in tokenizer.encode(text, add_special_tokens=False)
    pairs = {(r["prompt"][0]["content"], tuple(sorted(r["extra_info"]["lookup"].items()))) for r in rows}
    assert not pairs & {(r["prompt"][0]["content"], tuple(sorted(r["extra_info"]["lookup"].items()))) for r in val}


def test_the_intended_solution_scores_one_and_a_guess_cannot_read_the_table():
    import fleetrl.data.tasks  # noqa: F401

    row = SYNTHETIC_TASKS["lookup"](n=1, seed=2)[0]
    sample = {"ground_truth": row["reward_model"]["ground_truth"], "extra_info": row["extra_info"]}
    key = row["prompt"][0]["content"].split()[1]
    env = env_factory("lookup")(sample)
    env.reset(sample)
    observation = env.step(f"? {key}").observation
    assert observation == sample["ground_truth"]
    assert env.step(observation).reward == 1.0
    wrong = str((int(sample["ground_truth"]) + 1) % 10)
    fresh = env_factory("lookup")(sample)
    fresh.reset(sample)
    assert fresh.step(wrong).reward == 0.0
