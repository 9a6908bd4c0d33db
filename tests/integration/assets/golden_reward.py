"""A dense reward for the golden-loss runs: the copy task's 0/1 score leaves most groups with equal scores (zero
advantages, so a golden number would pin nothing), while this one differs between almost any two responses."""


def partial_credit(response, ground_truth, extra_info):
    text = response.strip()
    exact = 1.0 if text.split()[:1] == [ground_truth] else 0.0
    return exact + 0.05 * len(set(text)) + 0.01 * len(text)
