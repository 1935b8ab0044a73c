"""The training sampler (`batching.py`): length-grouped, optionally label-balanced batches."""

import random

from loracls.data.batching import LengthGroupedBatches, length_passes, padded_per_token


def test_length_grouped_batches_cover_every_example_once():
    lengths = [(i * 37) % 101 + 1 for i in range(1000)]
    sampler = LengthGroupedBatches(lengths, batch_size=16, shuffle=True, seed=3)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(1000))
        epochs.append(flat)
        # within a mega-batch examples are sorted, so batches are nearly uniform in length
        spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
        assert spread < 10
    assert epochs[0] != epochs[1]
    # length_grouping 1: random batches, every example once, lengths as mixed as the data
    batches = list(LengthGroupedBatches(lengths, batch_size=16, shuffle=True, seed=3, group=1))
    assert sorted(i for b in batches for i in b) == list(range(1000))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread > 60


def test_balanced_batches_keep_the_label_mix_where_length_goes_with_the_label():
    rng = random.Random(0)
    labels = [rng.choice("ab") for _ in range(960)]
    lengths = [rng.randint(20, 100) if y == "a" else rng.randint(5, 60) for y in labels]  # "a" texts longer

    def share_of_a(batches):
        return [sum(labels[i] == "a" for i in b) / len(b) for b in batches]

    sorted_batches = LengthGroupedBatches(lengths, 16, True, seed=1).batches()
    balanced = LengthGroupedBatches(lengths, 16, True, seed=1, labels=labels).batches()
    assert sorted(i for b in balanced for i in b) == list(range(960))
    assert sum(s in (0, 1) for s in share_of_a(sorted_batches)) > 15  # a plain sort: one-label batches
    overall = labels.count("a") / 960
    assert max(abs(s - overall) for s in share_of_a(balanced)) <= 0.1  # each batch keeps the mix
    # within each label the batch is still of similar length: padding stays far below random batches
    random_batches = LengthGroupedBatches(lengths, 16, True, seed=1, group=1).batches()

    def padded(batches):
        return sum(max(lengths[i] for i in b) * len(b) for b in batches)

    assert padded(sorted_batches) < padded(balanced) < 0.85 * padded(random_batches)


def test_eval_batches_are_sorted_by_length():
    lengths = [5, 1, 9, 3, 7]
    batches = LengthGroupedBatches(lengths, batch_size=2, shuffle=False).batches()
    assert batches == [[1, 3], [0, 4], [2]]


def test_inference_passes_keep_to_a_token_budget():
    """Passes of at most 4 texts and 40 padded tokens: short texts share wide passes, long ones narrow ones,
    a text over the budget has a pass of its own, and every text comes once, shortest first."""
    rng = random.Random(0)
    lengths = [rng.choice([3, 5, 8, 12, 20, 45]) for _ in range(60)]
    passes = length_passes(lengths, size=4, max_tokens=40)
    assert sorted(i for p in passes for i in p) == list(range(60))
    flat = [lengths[i] for p in passes for i in p]
    assert flat == sorted(flat)
    for p in passes:
        longest = max(lengths[i] for i in p)
        assert len(p) <= 4 and (len(p) * longest <= 40 or len(p) == 1)
    widths: dict[int, int] = {}  # the widest pass ending at each length
    for p in passes:
        widths[lengths[p[-1]]] = max(widths.get(lengths[p[-1]], 0), len(p))
    assert widths[3] == 4 and widths[12] == 3 and widths[20] == 2 and widths[45] == 1
    # without a budget: passes of `size` texts, as before
    assert [len(p) for p in length_passes(lengths, size=4)] == [4] * 15


def test_padding_counts_what_each_batch_pads_to_its_longest():
    lengths = [2, 4, 4, 8]
    assert padded_per_token(lengths, [[0, 1], [2, 3]]) == (2 * 4 + 2 * 8) / 18
    assert padded_per_token(lengths, [[0], [1, 2], [3]]) == 1.0
    # training's length grouping pads less than random batches of the same texts
    rng = random.Random(1)
    lengths = [rng.randint(5, 120) for _ in range(400)]
    grouped = LengthGroupedBatches(lengths, 8, shuffle=True, group=50).batches()
    random_batches = LengthGroupedBatches(lengths, 8, shuffle=True, group=1).batches()
    assert padded_per_token(lengths, grouped) < 1.1 < 1.5 < padded_per_token(lengths, random_batches)


def shard(sampler: LengthGroupedBatches, processes: int) -> list[list[list[int]]]:
    """What each of `processes` processes trains on, as accelerate shards the sampler (even_batches)."""
    from accelerate.data_loader import BatchSamplerShard

    return [
        list(BatchSamplerShard(sampler, processes, rank, split_batches=False)) for rank in range(processes)
    ]


def test_batches_shared_by_processes_train_every_example_once():
    """7 batches over 2 processes: accelerate filled the last round with the epoch's first batch again."""
    lengths = [random.Random(n).randint(1, 40) for n in range(13 * 8 + 5)]  # 14 batches of 8, the last 5
    for processes in (2, 3, 4):
        sampler = LengthGroupedBatches(lengths, 8, shuffle=True, seed=1, group=3, shards=processes)
        shards = shard(sampler, processes)
        assert len(sampler) % processes == 0 and len(sampler) == sum(len(s) for s in shards)
        assert len({len(s) for s in shards}) == 1  # every process the same number of micro-batches
        seen = sorted(i for s in shards for batch in s for i in batch)
        assert seen == list(range(len(lengths))), processes  # once each: nothing repeated, nothing lost
    unsplit = LengthGroupedBatches(lengths, 8, shuffle=True, seed=1, group=3)
    assert len(unsplit) == 14 and [len(b) for b in unsplit] == [len(b) for b in unsplit.batches()]
    repeated = sorted(i for s in shard(unsplit, 3) for batch in s for i in batch)
    assert len(repeated) > len(lengths)  # what happened before: the last round filled from the start
    singles = LengthGroupedBatches([3, 1, 2], 1, shuffle=True, shards=2)
    assert len(singles) == 3 == len(singles.batches())  # single examples cannot be halved
