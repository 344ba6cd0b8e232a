"""What a served model keeps resident, per item (issue 45: 10^7-item catalogues).

At 10^7 items every copy of the item table counts in gigabytes: the served model must hold
its quantized rows once (not also inside a TorchRec quantized EmbeddingCollection that
serving never reads), and an ANN catalogue must not keep an [N, D] fp32 copy of the item
vectors beside the index (the shortlist's vectors come from the served rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from genrec.config import to_dict
from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.models.hstu import HSTUConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.quant.ann import IndexConfig, index_artifact, item_vectors
from genrec.quant.artifact import Manifest, save_artifact
from genrec.quant.dense import dense_tensors
from genrec.quant.embeddings import table_tensors
from genrec.quant.load import load_model
from genrec.serve.ann import RetrievalConfig
from genrec.serve.catalogue import Catalogue

ITEMS = 3000


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained HSTU's int8 artifact (items 1..ITEMS, D = 16, an action table) with its index."""
    torch.manual_seed(0)
    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=16, num_embeddings=ITEMS + 1),
                                  TableConfig("action", ("action",), dim=16, num_embeddings=8)))
    cfg = ModelConfig(tower="hstu", max_seq_len=33, hstu=HSTUConfig(num_layers=1, qk_dim=8, v_dim=8, dropout=0.0))
    m = GenerativeRecommender(cfg, emb, torch.arange(1, ITEMS + 1)).eval()
    manifest = Manifest(model=to_dict(cfg), embedding=to_dict(emb),
                        quantization={"embeddings": "int8", "dense": "fp32", "row_alignment": 16})
    art = save_artifact(tmp_path_factory.mktemp("mem") / "art", manifest,
                        {"embeddings.safetensors": table_tensors(m.sparse, "int8"),
                         "dense.safetensors": dense_tensors(m, "fp32")})
    index_artifact(art, IndexConfig(factory="IVF16,PQ8x4fs", shortlist=200, target=0.95, k=50))
    return art


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_a_served_model_holds_its_item_rows_once(indexed):
    model, manifest = load_model(indexed)
    assert manifest.quantization["embeddings"] == "int8"
    rows = [b for b in model.buffers() if b.dim() == 2 and b.shape[0] >= ITEMS]  # table-sized tensors only
    dim = model.sparse.cfg.item_table.dim
    once = ITEMS * (dim + 4)  # int8 codes + fp16 scale and bias, a row
    assert rows, "the served rows are buffers of the model"
    assert _resident_bytes(rows) <= 1.1 * once  # one copy (a TorchRec quantized EC would add 80 bytes a row)
    model.train()
    with pytest.raises(RuntimeError, match="served rows only"):
        model.sparse.lookup(torch.tensor([1, 2]))


def test_an_ann_catalogue_keeps_no_fp32_copy_of_the_vectors(indexed):
    model, manifest = load_model(indexed)
    cat = Catalogue(model, None, indexed, manifest, RetrievalConfig(search="ann"))
    dim = model.sparse.cfg.item_table.dim
    big = [k for k, v in vars(cat).items()
           if isinstance(v, (np.ndarray, torch.Tensor)) and v.size and np.prod(v.shape) >= ITEMS * dim]
    assert not big, f"the ANN catalogue keeps {big}: an [N, D] copy beside the index and the rows"
    # ... and the vectors it computes for a shortlist are the ones exact search scores
    pos = np.array([[0, 17, ITEMS - 1], [5, 5, 2]])
    np.testing.assert_array_equal(cat.vectors_at(pos), item_vectors(model).numpy()[pos])
