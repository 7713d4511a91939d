"""The batch stream's order: a step's micro-batches come from one length bucket (equal work per replica), the
stream stays a pure function of (seed, group, index), and group 1 is the plain shuffle."""
import datasets
import pytest

from dflash.data.shards import write_manifest
from dflash.train.reader import ShardReader

SIZES = {16: 13, 32: 9, 64: 7}     # rows per bucket: batches of 2 leave partial groups in every bucket


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for edge, n in SIZES.items():
        rows = [[edge] * (edge - i % 3) for i in range(n)]
        datasets.Dataset.from_dict({"id": [f"{edge}-{i}" for i in range(n)], "input_ids": rows,
                                    "loss_mask": [[True] * len(r) for r in rows]}
                                   ).save_to_disk(str(root / "train" / f"bucket-{edge:05d}"))
    write_manifest(root, {"buckets": {str(e): n for e, n in SIZES.items()}, "num_samples": sum(SIZES.values())})
    return root


def plan(reader, epoch=0):
    B = reader.batches_per_epoch
    return [(b.input_ids.shape[1], tuple(b.ids)) for b in map(reader.batch, range(epoch * B, (epoch + 1) * B))]


@pytest.mark.parametrize("group", [2, 3, 4])
def test_a_steps_batches_share_a_bucket(data_dir, group):
    r = ShardReader(data_dir, batch_size=2, seed=5, group=group)
    plain_r = ShardReader(data_dir, batch_size=2, seed=5)
    B, batches = r.batches_per_epoch, plain_r.batches_per_epoch
    assert B % group == 0 and batches - group < B <= batches    # whole steps: every epoch starts on a step
    full = sum(n // 2 // group * group for n in SIZES.values())
    assert full <= B
    for epoch in (0, 1):
        p = plan(r, epoch)
        for g in range(0, full, group):
            assert len({edge for edge, _ in p[g:g + group]}) == 1, (epoch, p[g:g + group])
        # the plain shuffle's batches (nothing repeated; fewer than a step's worth left out), in another order
        plain = plan(plain_r, epoch)
        assert len(set(p)) == B and set(p) <= set(plain) and p != plain
    # resumable: a fresh reader gives the same batch at any index, next epoch included
    again = ShardReader(data_dir, batch_size=2, seed=5, group=group)
    i = B + 3
    assert again.batch(i).ids == r.batch(i).ids and tuple(again.batch(4).ids) == plan(r)[4][1]


def test_fewer_batches_than_one_step_is_refused(data_dir):
    from dflash.errors import UserError
    with pytest.raises(UserError, match="fewer than one optimizer step's 20 micro-batches"):
        ShardReader(data_dir, batch_size=2, seed=5, group=20)


def test_group_one_mixes_buckets(data_dir):
    p = plan(ShardReader(data_dir, batch_size=2, seed=5))
    assert any(p[i][0] != p[i + 1][0] for i in range(0, len(p) - 1, 2))   # why grouping is needed at all
