import torch

from fleetrl.batch import Batch
from fleetrl.workers.layout import micro_batches, pad_response


def test_micro_batches_drop_shared_padding_columns():
    # sample 0: prompt uses the last 2 of 4 columns, response 1 of 3; sample 1: prompt 3 columns, response 2
    b = Batch({"prompts": torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]]),
               "prompt_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]),
               "responses": torch.tensor([[4, 0, 0], [4, 4, 0]]),
               "response_mask": torch.tensor([[1, 0, 0], [1, 1, 0]]),
               "advantages": torch.tensor([[1.0, 0, 0], [2.0, 2.0, 0]]),
               "scores": torch.tensor([1.0, 0.0])})
    [mb] = micro_batches(b, 2)
    assert mb["prompts"].tolist() == [[0, 5, 6], [7, 8, 9]]  # column 0 is padding in both rows
    assert mb["responses"].tolist() == [[4, 0], [4, 4]]  # last column is padding in both rows
    assert mb["advantages"].shape == (2, 2) and mb["scores"].tolist() == [1.0, 0.0]
    assert "full_response_len" not in mb.meta  # a control value is never a meta key: the caller knows the width
    assert pad_response(torch.ones(2, 2), 3).tolist() == [[1, 1, 0], [1, 1, 0]]
