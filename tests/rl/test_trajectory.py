import pytest

from rl.trajectory import NOT_GENERATED, Trajectory, collate

N = NOT_GENERATED


def _traj(tokens, mask, lps, vers, reward=0.5, group=0):
    return Trajectory(tuple(tokens), tuple(mask), tuple(lps), tuple(vers), reward, group)


def test_collate_aligns_to_targets_and_pads():
    # prompt [1, 2], generated [3, 4], observation [5], generated [6]
    a = _traj([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], [0, 0, -0.5, -0.25, 0, -1.0], [N, N, 3, 3, N, 4], 1.0, 7)
    b = _traj([1, 9, 8], [0, 0, 1], [0, 0, -2.0], [N, N, 4], 0.0, 8)
    batch = collate([a, b], pad_id=258)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 9, 8, 258, 258, 258]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert batch.rollout_logprobs.tolist() == [[0, -0.5, -0.25, 0, -1.0], [0, -2.0, 0, 0, 0]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.group_ids.tolist() == [7, 8]
    assert a.num_generated == 3 and a.generated_versions == [3, 3, 4]


def test_select_trims_to_longest_selected_row():
    a = _traj([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1], [0, 0, -1, -1, -1, -1], [N, N, 0, 0, 0, 0])
    b = _traj([1, 9, 8], [0, 0, 1], [0, 0, -2.0], [N, N, 0])
    sub = collate([a, b], pad_id=258).select([1])
    assert sub.input_ids.tolist() == [[1, 9, 8]]
    assert sub.loss_mask.tolist() == [[0, 1]]
    assert sub.size == 1


@pytest.mark.parametrize("bad, match", [
    (dict(mask=[0, 1]), "loss_mask has 2 entries"),
    (dict(mask=[1, 0, 1]), "first token"),
    (dict(mask=[0, 2, 1]), "must be 0 or 1"),
    (dict(lps=[0, -1.0, -1.0]), "not generated but has logprob"),
    (dict(vers=[N, N, N]), "no weight version"),
])
def test_validation(bad, match):
    args = dict(tokens=[1, 2, 3], mask=[0, 0, 1], lps=[0, 0, -1.0], vers=[N, N, 0])
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        _traj(**args)


def test_collate_empty():
    with pytest.raises(ValueError):
        collate([], pad_id=0)
