"""The worst-case batch: the scan picks the samples that pad every field the most, and batches of
any size are built from them through the job's own collate function."""

from __future__ import annotations

from collections import UserDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autotune.errors import ConfigError, WorkloadError
from autotune.workloads.worstcase import WorstCase, find_worst_case, repeat_batch, to_device, worst_case_maker

CPU = torch.device("cpu")


def pad_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What a padding collator does: every field padded to the longest of the batch."""
    return {key: pad_sequence([s[key] for s in samples], batch_first=True) for key in samples[0]}


def seq(length: int, value: int = 1) -> torch.Tensor:
    return torch.full((length,), value, dtype=torch.long)


class Samples(Dataset[Any]):
    """A map-style dataset over a list that records which indices were read."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        self.reads.append(index)
        return self.items[index]


class Lazy(Dataset[dict[str, torch.Tensor]]):
    """A dataset too large to scan: sample i has a sequence of a length that jumps around with i."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.reads.append(index)
        return {"input_ids": seq(self.length(index))}

    @staticmethod
    def length(index: int) -> int:
        return (index * 7919) % 997 + 1


class Stream(IterableDataset[torch.Tensor]):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.iterations = 0
        self.yielded = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.iterations += 1
        for n in self.lengths:
            self.yielded += 1
            yield seq(n, value=n)


def test_scans_every_sample_and_picks_the_longest_sequence() -> None:
    lengths = [3, 7, 12, 5, 9]
    data = Samples([{"input_ids": seq(n, value=i + 1)} for i, n in enumerate(lengths)])

    worst = find_worst_case(data, pad_collate)

    assert worst.indices == (2,)
    assert (worst.scanned, worst.total, worst.seed) == (5, 5, None)
    assert sorted(set(data.reads)) == [0, 1, 2, 3, 4]
    assert worst.shapes == {"input_ids": [1, 12]}
    batch = worst_case_maker(data, pad_collate, worst)(4, CPU)
    assert torch.equal(batch["input_ids"], torch.full((4, 12), 3))  # every row is sample 2


def test_fields_whose_maxima_are_in_different_samples_pad_the_batch_to_both() -> None:
    # Sample 1 has the longest source, sample 0 the longest target: no single sample has both.
    data = Samples(
        [
            {"input_ids": seq(4), "labels": seq(15)},
            {"input_ids": seq(20), "labels": seq(3)},
            {"input_ids": seq(6), "labels": seq(5)},
        ]
    )

    worst = find_worst_case(data, pad_collate)

    assert worst.indices == (1, 0)  # most bytes in all first
    assert worst.shapes == {"input_ids": [2, 20], "labels": [2, 15]}
    make_batch = worst_case_maker(data, pad_collate, worst)
    assert make_batch(1, CPU)["input_ids"].shape == (1, 20)
    batch = make_batch(3, CPU)
    assert batch["input_ids"].shape == (3, 20)
    assert batch["labels"].shape == (3, 15)


@pytest.mark.parametrize("size", [50, 1_000_000])  # both ways of drawing: a permutation, and draws
def test_a_large_dataset_is_scanned_on_a_seeded_random_subset(size: int) -> None:
    data = Lazy(size)

    worst = find_worst_case(data, pad_collate, limit=10, seed=3)

    scanned = data.reads[:10]
    assert len(set(scanned)) == 10
    assert all(0 <= i < size for i in scanned)
    assert (worst.scanned, worst.total, worst.seed) == (10, size, 3)
    longest = max(scanned, key=lambda i: (Lazy.length(i), -i))
    assert worst.indices == (longest,)
    assert worst.shapes == {"input_ids": [1, Lazy.length(longest)]}
    assert f"of {size} (10 scanned at random, seed 3)" in worst.describe()

    again = Lazy(size)
    assert find_worst_case(again, pad_collate, limit=10, seed=3) == worst
    assert again.reads[:10] == scanned
    other = Lazy(size)
    find_worst_case(other, pad_collate, limit=10, seed=4)
    assert set(other.reads[:10]) != set(scanned)


def test_an_iterable_dataset_is_scanned_on_its_first_items_and_not_iterated_again() -> None:
    stream = Stream([2, 9, 4, 30, 1])

    worst = find_worst_case(stream, limit=3)

    assert (worst.indices, worst.scanned, worst.total, worst.seed) == ((1,), 3, None, None)
    assert stream.yielded == 3  # stopped at the limit: the 30 was never read
    assert worst.shapes == {"batch": [1, 9]}
    batch = worst_case_maker(stream, None, worst)(5, CPU)
    assert torch.equal(batch, torch.full((5, 9), 9))
    assert stream.iterations == 1
    assert worst.describe() == "sample 1 of an unsized dataset (first 3 scanned): batch [1, 9]"


def test_a_worst_case_made_elsewhere_for_an_iterable_dataset_is_read_back_by_position() -> None:
    stream = Stream([2, 9, 4, 30])
    worst = WorstCase(indices=(3, 1), scanned=4, total=None, seed=None, shapes={"batch": [2, 30]})

    batch = worst_case_maker(stream, lambda s: pad_sequence(s, batch_first=True), worst)(3, CPU)

    assert batch[:, 0].tolist() == [30, 9, 30]
    assert batch.shape == (3, 30)


def test_a_dataloader_brings_its_dataset_and_collate_fn() -> None:
    def keyed(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"tokens": pad_sequence(samples, batch_first=True)}

    data = Samples([seq(3), seq(8), seq(5)])
    loader = DataLoader(data, batch_size=2, collate_fn=keyed)

    worst = find_worst_case(loader)

    assert worst.indices == (1,)
    assert worst.shapes == {"tokens": [1, 8]}
    assert worst_case_maker(loader, None, worst)(3, CPU)["tokens"].shape == (3, 8)
    # A collate given explicitly wins over the loader's.
    assert find_worst_case(loader, lambda s: pad_sequence(s, batch_first=True)).shapes == {"batch": [1, 8]}


def test_a_dataloader_without_automatic_batching_is_refused() -> None:
    with pytest.raises(WorkloadError, match="batch_size=None"):
        find_worst_case(DataLoader(Samples([seq(3)]), batch_size=None))


def test_tuple_samples_are_named_by_position() -> None:
    data = Samples([(torch.zeros(3), 0), (torch.zeros(3), 1)])

    worst = find_worst_case(data)

    assert worst.indices == (0,)  # a tie goes to the lowest index
    assert worst.shapes == {"0": [1, 3], "1": [1]}


def image(height: int, width: int) -> torch.Tensor:
    return torch.ones(3, height, width)


def pad_images(samples: list[Any]) -> dict[str, torch.Tensor]:
    """Every image padded to the tallest and the widest of its batch, every caption to the longest."""
    images = [s["pixels"] for s in samples]
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    pixels = torch.zeros(len(samples), 3, height, width)
    for row, i in enumerate(images):
        pixels[row, :, : i.shape[1], : i.shape[2]] = i
    batch = {"pixels": pixels}
    if "caption" in samples[0]:
        batch["caption"] = pad_sequence([s["caption"] for s in samples], batch_first=True)
    return batch


def test_images_of_both_orientations_pad_to_the_tallest_and_the_widest() -> None:
    """The largest image (56x64) alone is not the worst batch: the tallest (64x48) and it pad to
    64x64, which no image is. Each dimension's leader is kept, and batches pad to all of them."""
    data = Samples([{"pixels": image(h, w)} for h, w in [(32, 40), (56, 64), (40, 32), (64, 48), (48, 56)]])

    worst = find_worst_case(data, pad_images)

    assert worst.indices == (1, 3)  # the largest, then the tallest; the largest is also the widest
    assert worst.shapes == {"pixels": [2, 3, 64, 64]}
    make_batch = worst_case_maker(data, pad_images, worst)
    assert make_batch(1, CPU)["pixels"].shape == (1, 3, 56, 64)  # one row: the largest image alone
    assert make_batch(5, CPU)["pixels"].shape == (5, 3, 64, 64)


def test_two_padded_fields_keep_each_dimensions_leader_and_the_smaller_batches_their_largest_subset() -> None:
    """Images and captions: the tallest, the widest and the longest caption are three samples, and
    the largest in all a fourth; a batch of two takes the pair that pads largest."""
    data = Samples(
        [
            {"pixels": image(64, 16), "caption": seq(4)},  # the tallest
            {"pixels": image(16, 64), "caption": seq(4)},  # the widest
            {"pixels": image(16, 16), "caption": seq(90)},  # the longest caption
            {"pixels": image(40, 40), "caption": seq(8)},  # the most bytes in all
            {"pixels": image(8, 8), "caption": seq(2)},
        ]
    )

    worst = find_worst_case(data, pad_images)

    assert sorted(worst.indices) == [0, 1, 2, 3]
    assert worst.indices[0] == 3  # the largest first: a batch of one is the worst sample alone
    assert worst.shapes == {"pixels": [4, 3, 64, 64], "caption": [4, 90]}
    make_batch = worst_case_maker(data, pad_images, worst)
    for size in (4, 7):
        batch = make_batch(size, CPU)
        assert batch["pixels"].shape == (size, 3, 64, 64) and batch["caption"].shape == (size, 90)
    pair = make_batch(2, CPU)  # the tallest and the widest: 2x3x64x64 floats outweigh any caption
    assert pair["pixels"].shape == (2, 3, 64, 64) and pair["caption"].shape == (2, 4)
    assert make_batch(1, CPU)["pixels"].shape == (1, 3, 40, 40)


@pytest.mark.parametrize(("size", "longest_input"), [(1, 4), (2, 6), (5, 6)])  # one row: the worst sample alone
def test_make_batch_returns_size_rows_cycling_through_the_worst_samples(size: int, longest_input: int) -> None:
    data = Samples([{"input_ids": seq(4, value=7), "labels": seq(9, value=8)}, {"input_ids": seq(6), "labels": seq(1)}])
    worst = find_worst_case(data, pad_collate)
    assert worst.indices == (0, 1)

    batch = worst_case_maker(data, pad_collate, worst)(size, CPU)

    assert batch["input_ids"].shape == (size, longest_input)
    assert batch["labels"].shape == (size, 9)
    assert [int(row[0]) for row in batch["labels"]] == [8 if j % 2 == 0 else 1 for j in range(size)]


def test_make_batch_reads_the_worst_samples_once_and_moves_the_batch_to_the_device() -> None:
    data = Samples([{"input_ids": seq(n)} for n in (2, 6, 3)])
    make_batch = worst_case_maker(data, pad_collate, limit=100)  # scans here
    reads = len(data.reads)

    batches = [make_batch(b, torch.device("meta")) for b in (1, 4, 16)]

    assert len(data.reads) == reads
    assert [b["input_ids"].shape for b in batches] == [(1, 6), (4, 6), (16, 6)]
    assert all(b["input_ids"].is_meta for b in batches)
    with pytest.raises(ConfigError):
        make_batch(0, CPU)
    with pytest.raises(ConfigError, match="limit"):
        worst_case_maker(data, pad_collate, find_worst_case(data, pad_collate), limit=1)


def test_repeat_batch_tiles_the_rows_of_every_batch_tensor() -> None:
    x = torch.arange(6).view(3, 2)
    batch = {"x": x, "y": torch.tensor([10, 11, 12]), "scale": torch.tensor(2.0), "other": torch.zeros(5), "id": "a"}

    out = repeat_batch(batch, 7)

    assert out["x"][:, 0].tolist() == [0, 2, 4, 0, 2, 4, 0]
    assert out["y"].tolist() == [10, 11, 12, 10, 11, 12, 10]
    assert out["scale"] is batch["scale"]
    assert out["other"] is batch["other"]  # not of the batch's length: not a per-row tensor
    assert out["id"] == "a"
    assert repeat_batch((x, batch["y"]), 2)[1].tolist() == [10, 11]
    out["x"].zero_()
    assert x.sum() == 15  # a copy: the probe pays for every row


def test_repeat_batch_needs_a_batch_with_rows() -> None:
    with pytest.raises(ConfigError):
        repeat_batch({"x": torch.zeros(2, 3)}, 0)
    with pytest.raises(ConfigError, match="count"):
        repeat_batch("not a batch", 4)


class Encoding(UserDict[str, Any]):
    """Like Hugging Face's BatchEncoding: a UserDict with state of its own."""

    def __init__(self, data: dict[str, Any], note: str = "") -> None:
        super().__init__(data)
        self.note = note


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


def test_to_device_moves_every_tensor_and_keeps_the_containers() -> None:
    batch: dict[str, Any] = {
        "enc": Encoding({"input_ids": torch.ones(2, 3)}, note="kept"),
        "pair": Pair(torch.zeros(2, 4), 5),
        "list": [torch.zeros(1), "text"],
        "tuple": (torch.zeros(1),),
    }

    moved = to_device(batch, torch.device("meta"))

    assert isinstance(moved["enc"], Encoding)
    assert moved["enc"].note == "kept"
    assert moved["enc"]["input_ids"].is_meta
    assert not batch["enc"]["input_ids"].is_meta  # the original is untouched
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].image.is_meta
    assert moved["pair"].label == 5
    assert isinstance(moved["list"], list)
    assert moved["list"][0].is_meta
    assert moved["list"][1] == "text"
    assert isinstance(moved["tuple"], tuple)
    assert moved["tuple"][0].is_meta


def test_a_hugging_face_batch_encoding_stays_one() -> None:
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)})

    moved = to_device(repeat_batch(encoding, 5), torch.device("meta"))

    assert isinstance(moved, transformers.BatchEncoding)
    assert moved.input_ids.shape == (5, 3)
    assert moved.input_ids.is_meta


@pytest.mark.parametrize("data", [Samples([]), Stream([])], ids=["map-style", "iterable"])
def test_an_empty_dataset_is_a_workload_error(data: Any) -> None:
    with pytest.raises(WorkloadError, match="empty"):
        find_worst_case(data)


def test_a_sample_the_collate_function_rejects_is_named_with_the_collate_functions_place() -> None:
    def picky(samples: list[int]) -> torch.Tensor:
        if 5 in samples:
            raise ValueError("five is not allowed")
        return torch.tensor(samples)

    line = picky.__code__.co_firstlineno
    with pytest.raises(WorkloadError) as caught:
        find_worst_case(Samples(list(range(8))), picky)
    assert str(caught.value) == (
        f"collating sample 5 alone failed: ValueError: five is not allowed (at tests/test_worstcase.py:{line + 2} in "
        f"picky); the collate function: {picky.__qualname__} at tests/test_worstcase.py:{line}"
    )
    assert isinstance(caught.value.__cause__, ValueError)  # the job's own error, kept


def test_a_field_the_collate_function_asks_for_and_the_sample_lacks_is_named() -> None:
    def with_lengths(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"tokens": pad_sequence([s["tokens"] for s in samples], batch_first=True),
                "lengths": torch.tensor([len(s["lengths"]) for s in samples])}  # fmt: skip

    with pytest.raises(WorkloadError, match=r"sample 0 has no field 'lengths' \(its fields: tokens, label\)"):
        find_worst_case(Samples([{"tokens": seq(3), "label": seq(1)}]), with_lengths)


def test_samples_that_torchs_default_collate_cannot_stack_name_the_field_and_collate() -> None:
    """Accelerate's and from_model's Dataset without collate= are collated by torch's default_collate."""
    data = Samples([{"tokens": seq(12), "labels": seq(30)}, {"tokens": seq(40), "labels": seq(3)}])

    with pytest.raises(WorkloadError) as caught:
        find_worst_case(data)
    message = str(caught.value)
    assert message.startswith("collating 2 samples from 1, 0 failed: RuntimeError: stack expects each tensor")
    assert "(field 'tokens' is [40] in sample 1, [12] in sample 0; field 'labels' is [3] in sample 1, [30] in " in (
        message
    )
    assert message.endswith(
        "torch's default_collate stacks samples of one size only: pass collate=, the collate function of the job's "
        "DataLoader (a DataLoader brings its own)"
    )


def test_describe_and_input_spec_of_a_full_scan() -> None:
    data = Samples([{"input_ids": seq(n), "labels": seq(n)} for n in (10, 64, 3)])

    worst = find_worst_case(data, pad_collate)

    assert worst.describe() == "sample 1 of 3 (all scanned): input_ids [1, 64], labels [1, 64]"
    assert worst.input_spec() == {
        "worst_samples": "1",
        "scanned": 3,
        "total": 3,
        "input_ids": "1x64",
        "labels": "1x64",
    }


def test_describe_and_input_spec_of_a_random_subset() -> None:
    worst = WorstCase(
        indices=(3, 9),
        scanned=10_000,
        total=1_000_000,
        seed=0,
        shapes={"input_ids": [2, 64], "scanned": [2], "loss_scale": []},
    )

    assert worst.describe() == (
        "samples 3, 9 of 1000000 (10000 scanned at random, seed 0): input_ids [2, 64], scanned [2], loss_scale []"
    )
    assert worst.input_spec() == {
        "worst_samples": "3,9",
        "scanned": 10_000,
        "total": 1_000_000,
        "seed": 0,
        "input_ids": "2x64",
        "shape.scanned": "2",  # a field named like ours does not overwrite it
        "loss_scale": "scalar",
    }
