"""Quantization: each transform against its float reference, the artifact round trip, and
every kind of damaged artifact refused with a message naming the problem."""

import json
import shutil

import pytest
import torch

from genrec.embedding.qat import fake_quantize_rows
from genrec.quant.artifact import ArtifactError
from genrec.quant.convert import (
    QuantizeConfig,
    export,
    format_report,
    load_training_model,
    resolve_checkpoint,
)
from genrec.quant.dense import (
    Fp8WeightLinear,
    dequantize_linear_weight,
    int8_dynamic_linear,
    quantize_linear_weight,
)
from genrec.quant.embeddings import dequantize, quantize_weight
from genrec.quant.load import load_model
from genrec.train.data.reader import make_reader
from genrec.train.eval.evaluate import evaluate
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from tests.conftest import tiny_job_overrides


@pytest.mark.parametrize("scheme,levels", [("int8", 255), ("int4", 15)])
def test_rowwise_tables_stay_within_half_a_step(scheme, levels):
    w = torch.randn(500, 64) * torch.rand(500, 1) * 3
    parts = quantize_weight(w, scheme)
    back = dequantize(parts, scheme, 64)
    step = (w.amax(1) - w.amin(1)) / levels
    assert ((back - w).abs() <= step[:, None] / 2 * 1.01 + 1e-3).all()
    assert parts["codes"].dtype == torch.uint8 and parts["scale_bias"].shape == (500, 4)
    assert parts["codes"].shape[1] == 64 * {"int8": 8, "int4": 4}[scheme] // 8


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_dims_refused_up_front_are_exactly_those_fbgemm_cannot_pack(scheme):
    """``genrec quantize`` checks every table's dim before loading data or evaluating: the rule
    matches what fbgemm's packing accepts (else it failed late, with fbgemm's own message)."""
    from genrec.quant.embeddings import check_dims, quantize_weight

    for d in range(1, 18):
        try:
            quantize_weight(torch.randn(3, d), scheme)
            packs = True
        except RuntimeError:
            packs = False
        if packs:
            check_dims({"item": d}, scheme)
        else:
            with pytest.raises(ValueError, match=rf"'item' \(dim {d}\)"):
                check_dims({"item": d}, scheme)
    check_dims({"item": 7}, "fp16")


def test_fp16_tables_round_to_half_precision():
    w = torch.randn(50, 16)
    torch.testing.assert_close(dequantize(quantize_weight(w, "fp16"), "fp16", 16), w, rtol=1e-3, atol=1e-3)


def test_torchrec_quantized_lookup_matches_the_float_table():
    from genrec.embedding.collection import SparseArch
    from genrec.embedding.spec import EmbeddingConfig, TableConfig
    from genrec.quant.embeddings import quantized_modules, table_tensors

    cfg = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=32, num_embeddings=300),))
    arch = SparseArch(cfg)
    ids = torch.tensor([0, 5, 299, 17])
    ref = arch.lookup(ids)
    for scheme, tol in (("fp16", 1e-3), ("int8", 0.01), ("int4", 0.1)):
        ec, _ = quantized_modules(cfg, table_tensors(arch, scheme), scheme)
        arch_q = SparseArch(cfg)
        arch_q.ec = ec
        got = arch_q.lookup(ids)
        assert (got - ref).abs().max() < tol * ref.abs().max(), scheme


@pytest.mark.parametrize("scheme", ["fp32", "fp16", "int8", "int4"])
def test_served_direct_rows_equal_the_quantized_collection(scheme):
    """Inference reads sequence rows straight from the packed table (ServedRows); they must
    be the rows TorchRec's quantized EmbeddingCollection returns, for the sequence KJT too."""
    from torchrec import KeyedJaggedTensor

    from genrec.embedding.collection import SparseArch
    from genrec.embedding.spec import EmbeddingConfig, TableConfig
    from genrec.quant.embeddings import install, quantized_modules, served_rows, table_tensors

    cfg = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=32, num_embeddings=300),
                                  TableConfig("action", ("action",), dim=32, num_embeddings=8)))
    tensors = table_tensors(SparseArch(cfg), scheme)
    via_ec, direct = SparseArch(cfg).eval(), SparseArch(cfg).eval()
    ec, _ = quantized_modules(cfg, tensors, scheme)
    via_ec.ec = ec
    install(direct, ec, None, served_rows(cfg, tensors, scheme))
    ids = torch.tensor([0, 5, 299, 17, 5])
    torch.testing.assert_close(direct.lookup(ids), via_ec.lookup(ids), rtol=0, atol=0)
    torch.testing.assert_close(direct.lookup(torch.tensor([1, 7]), "action"), via_ec.lookup(torch.tensor([1, 7]), "action"))
    kjt = KeyedJaggedTensor(keys=["item", "action"], values=torch.tensor([3, 4, 5, 9, 1, 2, 3, 0]),
                            lengths=torch.tensor([3, 1, 3, 1]))
    a, b = direct(kjt), via_ec(kjt)
    assert a.keys() == b.keys()
    for f in a:
        torch.testing.assert_close(a[f].values(), b[f].values(), rtol=0, atol=0)
        torch.testing.assert_close(a[f].lengths(), b[f].lengths())
    direct.train()  # training never takes the direct path
    assert direct(kjt)["item"].values().shape == (4, 32)


@pytest.mark.parametrize("scheme,rel", [("int8", 0.02), ("fp8", 0.08)])
def test_quantized_linear_layers_track_the_float_layer(scheme, rel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(16, 64)
    ref = lin(x)
    codes, scale = quantize_linear_weight(lin.weight.data, scheme)
    assert ((dequantize_linear_weight(codes, scale) - lin.weight).abs() <= scale[:, None] * (0.51 if scheme == "int8" else 16)).all()
    layer = int8_dynamic_linear(codes, scale, lin.bias.data) if scheme == "int8" else Fp8WeightLinear(codes, scale, lin.bias.data)
    out = layer(x)
    assert (out - ref).abs().max() < rel * ref.abs().max()


def test_qat_rows_sit_on_the_serving_grid_and_pass_gradients_straight_through():
    x = torch.randn(10, 16, requires_grad=True)
    y = fake_quantize_rows(x, 4)
    parts = quantize_weight(x.detach(), "int4")
    torch.testing.assert_close(y.detach(), dequantize(parts, "int4", 16), atol=2e-3, rtol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


@pytest.fixture(scope="module")
def trained_run(tiny_synth, tmp_path_factory):
    out = tmp_path_factory.mktemp("qrun")
    cfg = out / "tiny.toml"
    cfg.write_text('[[embedding.tables]]\nname = "item"\nfeatures = ["item"]\ndim = 16\n')
    run_dir, _ = run_training(load_job(cfg, tiny_job_overrides(tiny_synth, out) + ["--train.max_epochs=1"]))
    return run_dir


@pytest.mark.parametrize("emb,dense", [("int8", "fp32"), ("int4", "int8"), ("fp16", "bf16"), ("fp32", "fp8")])
def test_artifact_round_trip_serves_what_was_measured(trained_run, tiny_synth, tmp_path, emb, dense):
    art = tmp_path / "art"
    report = export(trained_run, art, QuantizeConfig(embeddings=emb, dense=dense), progress=False)
    assert report["sizes"]["embeddings"]["after"] < report["sizes"]["embeddings"]["before"] or emb == "fp32"
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["quantization"]["embeddings"] == emb and manifest["source"]["checkpoint"].startswith("step_")
    model, _ = load_model(art)
    job = load_job(trained_run / "config.toml")
    again = evaluate(model, make_reader(job.data, "valid", job.embedding, job.model.max_seq_len))
    assert again["ndcg@10"] == pytest.approx(report["metrics"]["after"]["ndcg@10"], abs=1e-9)
    _, float_model = load_training_model(*resolve_checkpoint(trained_run))
    if emb == "fp32" and dense == "fp32":
        assert again == report["metrics"]["before"]
    # quantized or not, the artifact ranks close to the float model
    assert abs(again["hr@50"] - report["metrics"]["before"]["hr@50"]) < 0.05
    # ... and the server's engine loads it and answers, on its default path (the native kernel
    # and bf16 GEMMs read plain weights; quantized dense layers run their own forward)
    from genrec.proto.v1 import recommender_pb2 as pb
    from genrec.serve.engine import TorchEngine
    from genrec.serve.requests import Limits, decode

    engine = TorchEngine(art)
    assert (engine.path == "native") == (dense in ("fp32", "bf16") and engine.model.tower.native_supported())
    ids = engine.corpus_np[:6]
    req = pb.RecommendRequest(user=pb.User(history=[pb.Event(item_id=int(i), timestamp=1_700_000_000 + 60 * k)
                                                    for k, i in enumerate(ids)]), retrieve_k=10)
    (res,) = engine.run([decode("recommend", req.SerializeToString(), engine.schema, Limits())])
    assert len(res.item_ids) == 10 and set(res.item_ids.tolist()) <= set(engine.corpus_np.tolist())


def test_managed_collision_tables_export_their_raw_id_map(tiny_synth, tmp_path):
    """An MCH item table (raw ids, fewer rows than items, so the module evicts) exports its
    raw-id -> row map: the artifact looks raw ids up as the trained model does, kept ids
    and missed ones (the shared miss row) alike, and ranks exactly as measured."""
    cfg = tmp_path / "mch.toml"
    cfg.write_text('[[embedding.tables]]\nname = "item"\nfeatures = ["item"]\ndim = 16\nnum_embeddings = 256\n'
                   'oov = "mch"\nraw_id_space = 1000000\nmch_eviction_interval = 4\nmch_buckets = 1\n')
    run_dir, _ = run_training(load_job(cfg, tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_epochs=1"]))
    art = tmp_path / "art"
    report = export(run_dir, art, QuantizeConfig(embeddings="fp32", dense="fp32"), progress=False)
    files = json.loads((art / "manifest.json").read_text())["tensors"]["embeddings.safetensors"]
    kept = files["item.mch_ids"]["shape"][0]
    assert 0 < kept < 256 and files["item.mch_rows"]["shape"] == [kept]
    served, _ = load_model(art)
    _, trained = load_training_model(*resolve_checkpoint(run_dir))
    ids = torch.cat([served.sparse.rows["item"].mch_ids[:50], torch.tensor([0, 999_999, 123_457])])
    torch.testing.assert_close(served.sparse.lookup(ids), trained.sparse.lookup(ids), atol=0, rtol=0)
    assert (served.sparse.rows["item"].row_ids(torch.tensor([999_999])) == 255).all()  # missed: the last row
    job = load_job(run_dir / "config.toml")
    again = evaluate(served, make_reader(job.data, "valid", job.embedding, job.model.max_seq_len))
    assert again == report["metrics"]["before"]
    int8 = tmp_path / "int8"
    export(run_dir, int8, QuantizeConfig(embeddings="int8"), progress=False, measure_accuracy=False)
    torch.testing.assert_close(load_model(int8)[0].sparse.lookup(ids), trained.sparse.lookup(ids), atol=0.02, rtol=0)


def test_report_of_a_model_with_zero_metrics_prints_absolute_changes():
    sizes = {"embeddings": {"before": 400, "after": 100, "scheme": "int8"}, "dense": {"before": 100, "after": 100, "scheme": "fp32"}}
    zero = {k: 0.0 for k in ("hr@10", "ndcg@10", "hr@50", "mrr")}
    text = format_report({"sizes": sizes, "metrics": {"split": "valid", "before": zero, "after": {**zero, "mrr": 0.001}}})
    assert "| hr@10 | 0.0000 | 0.0000 | +0.0000 (absolute) |" in text and "+0.0010 (absolute)" in text


@pytest.fixture()
def artifact(trained_run, tmp_path):
    art = tmp_path / "art"
    export(trained_run, art, QuantizeConfig(embeddings="int8"), progress=False)
    return art


def test_corrupted_tensor_is_named(artifact):
    path = artifact / "embeddings.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"tensor '.*' does not match its checksum"):
        load_model(artifact)


def test_wrong_shape_is_named(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    name = next(iter(m["tensors"]["dense.safetensors"]))
    m["tensors"]["dense.safetensors"][name]["shape"] = [7, 7]
    (artifact / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=rf"tensor '{name}' has shape .* the manifest says \[7, 7\]"):
        load_model(artifact)


def test_missing_file_is_named(artifact):
    (artifact / "dense.safetensors").unlink()
    with pytest.raises(ArtifactError, match="dense.safetensors is missing"):
        load_model(artifact)


def test_newer_format_version_is_refused(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    m["format_version"] = 99
    (artifact / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="format_version 99 is newer"):
        load_model(artifact)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format_version=0), "format_version '0' is not one"),
    (lambda m: m.update(format_version=True), "format_version 'True' is not one"),
    (lambda m: m["quantization"].update(embeddings="int2"), r"quantization.embeddings = 'int2'"),
    (lambda m: m["quantization"].update(dense=None), r"quantization.dense = 'None'"),
    (lambda m: m["quantization"].update(row_alignment=0), "row_alignment = '0'"),
    (lambda m: m["tensors"]["dense.safetensors"].update(corpus_ids={"dtype": "int64"}), "entry of tensor 'corpus_ids'"),
])
def test_a_manifest_field_that_cannot_be_served_is_refused_naming_it(artifact, edit, message):
    m = json.loads((artifact / "manifest.json").read_text())
    edit(m)
    (artifact / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=message):
        load_model(artifact)


def test_the_manifest_check_knows_every_scheme_the_quantizers_write():
    from typing import get_args

    from genrec.quant import artifact, dense, embeddings

    assert artifact.EMBEDDING_SCHEMES == get_args(embeddings.Scheme)
    assert artifact.DENSE_SCHEMES == get_args(dense.Scheme)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="no manifest.json"):
        load_model(tmp_path)
    shutil.rmtree(tmp_path)
