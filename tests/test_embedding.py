import numpy as np
import pytest
import torch
from torchrec import EmbeddingCollection, KeyedJaggedTensor

from genrec.embedding.collection import SparseArch
from genrec.embedding.spec import EmbeddingConfig, IdOutOfRange, TableConfig, hash_ids, prepare_ids


def spec():
    return EmbeddingConfig(tables=(
        TableConfig("item", ("item",), dim=8, num_embeddings=100),
        TableConfig("action", ("action",), dim=8, num_embeddings=4),
        TableConfig("region", ("region",), dim=4, num_embeddings=10, pooling="sum"),
    ))


def test_sparse_arch_is_real_torchrec_and_lookup_matches_forward():
    arch = SparseArch(spec())
    assert isinstance(arch.ec, EmbeddingCollection)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action"], values=torch.tensor([5, 9, 2, 7, 1, 0, 3, 2]),
        lengths=torch.tensor([3, 1, 3, 1]))
    out = arch(kjt)
    assert out["item"].values().shape == (4, 8) and out["item"].lengths().tolist() == [3, 1]
    torch.testing.assert_close(arch.lookup(torch.tensor([5, 9, 2, 7])), out["item"].values())
    torch.testing.assert_close(arch.lookup(torch.tensor([1, 0]), "action"), out["action"].values()[:2])
    pooled = arch.pooled(KeyedJaggedTensor.from_lengths_sync(
        keys=["region"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])))
    assert pooled["region"].shape == (2, 4)


def test_spec_validation_names_the_problem():
    with pytest.raises(ValueError, match="read by tables 'a' and 'b'"):
        EmbeddingConfig(tables=(TableConfig("a", ("x",)), TableConfig("b", ("x",))), item_feature="x")
    with pytest.raises(ValueError, match="share one dim"):
        EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8), TableConfig("a", ("a",), dim=4)))
    with pytest.raises(ValueError, match="item_feature 'item'"):
        EmbeddingConfig(tables=(TableConfig("a", ("a",)),))


def test_prepare_ids_errors_or_hashes():
    t = TableConfig("item", ("item",), num_embeddings=10)
    assert prepare_ids(t, "item", np.array([0, 9])).tolist() == [0, 9]
    with pytest.raises(IdOutOfRange, match="id 10 is outside the table's range"):
        prepare_ids(t, "item", np.array([3, 10]))
    with pytest.raises(IdOutOfRange, match="id -1"):
        prepare_ids(t, "item", np.array([-1]))
    h = TableConfig("item", ("item",), num_embeddings=10, oov="hash")
    out = prepare_ids(h, "item", np.array([3, 10, 10**12, -5]))
    assert out[0] == 3 and ((out >= 0) & (out < 10)).all()
    assert (hash_ids(np.array([10**12]), 10) == out[2]).all()  # deterministic


def test_managed_collision_tables_remap_raw_ids_evict_and_keep_a_miss_row():
    cfg = EmbeddingConfig(tables=(
        TableConfig("item", ("item",), dim=8, num_embeddings=64, oov="mch", raw_id_space=10**8,
                    mch_eviction_interval=2, mch_buckets=1),
        TableConfig("action", ("action",), dim=8, num_embeddings=4),
    ))
    arch = SparseArch(cfg)
    assert arch.mc_ec is not None and arch.plain_features == ["action"]
    rng = np.random.default_rng(0)
    popular = rng.integers(0, 10**8, 16)
    for _ in range(8):  # popular ids recur, fresh random ids keep arriving
        ids = np.concatenate([popular, rng.integers(0, 10**8, 40)])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["item", "action"], values=torch.from_numpy(np.concatenate([ids, np.ones(ids.size, np.int64)])),
            lengths=torch.tensor([ids.size, ids.size]))
        out = arch(kjt)
        assert out["item"].values().shape == (ids.size, 8) and out["action"].values().shape == (ids.size, 8)
        out["item"].values().sum().backward()
    arch.eval()
    kept = arch.lookup(torch.from_numpy(popular))
    unseen = arch.lookup(torch.tensor([123, 456_789]))
    torch.testing.assert_close(unseen[0], unseen[1])  # never-kept ids share the miss row
    assert not torch.allclose(kept[0], unseen[0])  # popular ids kept rows of their own
    with pytest.raises(IdOutOfRange):
        prepare_ids(cfg.item_table, "item", np.array([10**8]))
    assert prepare_ids(cfg.item_table, "item", np.array([10**8 - 1])).tolist() == [10**8 - 1]
