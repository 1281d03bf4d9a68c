//! DistilBERT beyond what every family shares (tests/switches/families.rs holds its hidden states,
//! poolings, gradients and exports against transformers): its `config.json` speaks its own
//! names (`dim`, `n_layers`, `n_heads`, `hidden_dim`, `activation`, `dropout`,
//! `attention_dropout`), read under BERT's and written back under its own, with
//! transformers' defaults for the ones a file leaves out; errors name its own keys; a
//! fresh table of `sinusoidal_pos_embds` starts from the sinusoids transformers writes;
//! dropout falls where DistilBERT's block puts it (not on the attention's output).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions};
use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::ParamStore;

use crate::common;
use crate::common::families::fixture;

fn config(dir: &Path, edit: impl Fn(&mut serde_json::Value)) -> std::path::PathBuf {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("distilbert").join("config.json")).unwrap(),
    )
    .unwrap();
    edit(&mut cfg);
    let path = dir.join("config.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

/// The DistilBERT fixture's files in `dir`.
fn copy_fixture(dir: &Path) {
    let src = fixture("distilbert");
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    let pooling = "1_Pooling/config.json";
    std::fs::copy(src.join(pooling), dir.join(pooling)).unwrap();
}

#[test]
fn the_config_is_read_under_berts_names_and_written_back_under_its_own() {
    let cfg = BertConfig::from_file(&fixture("distilbert").join("config.json")).unwrap();
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.intermediate_size
        ),
        (32, 2, 4, 64)
    );
    assert_eq!(cfg.hidden_act, "gelu");
    assert_eq!(cfg.hidden_dropout_prob, 0.1);
    assert_eq!(cfg.attention_probs_dropout_prob, 0.1);
    assert_eq!(cfg.max_tokens(), 40, "positions count from 0");
    let json = cfg.to_json();
    for (key, value) in [
        ("dim", 32.0),
        ("n_layers", 2.0),
        ("n_heads", 4.0),
        ("hidden_dim", 64.0),
        ("dropout", 0.1),
        ("attention_dropout", 0.1),
    ] {
        assert_eq!(json[key].as_f64(), Some(value), "{key}");
    }
    assert_eq!(json["activation"], "gelu");
    assert_eq!(json["model_type"], "distilbert");
    for bert_only in [
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "hidden_act",
        "type_vocab_size",
        "layer_norm_eps",
        "hidden_dropout_prob",
    ] {
        assert!(json.get(bert_only).is_none(), "{bert_only} written");
    }
    // Written and read again: the same config.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("config.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let again = BertConfig::from_file(&path).unwrap();
    assert_eq!(
        (again.to_json(), again.hidden_size, again.vocab_size),
        (json, 32, cfg.vocab_size)
    );
}

#[test]
fn keys_a_file_leaves_out_take_transformers_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), |c| {
        for key in [
            "dim",
            "n_layers",
            "n_heads",
            "hidden_dim",
            "activation",
            "dropout",
        ] {
            c.as_object_mut().unwrap().remove(key);
        }
    });
    let cfg = BertConfig::from_file(&path).unwrap();
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.intermediate_size
        ),
        (768, 6, 12, 3072)
    );
    assert_eq!(
        (cfg.hidden_act.as_str(), cfg.hidden_dropout_prob),
        ("gelu", 0.1)
    );
}

#[test]
fn bad_values_are_refused_under_distilberts_own_names() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, serde_json::Value); 4] = [
        ("n_heads", 5.into()),
        ("dim", 0.into()),
        ("dropout", 1.0.into()),
        ("activation", "softplus".into()),
    ];
    for (key, value) in cases {
        let path = config(tmp.path(), |c| c[key] = value.clone());
        let err = BertConfig::from_file(&path).unwrap_err().to_string();
        assert!(
            err.contains(&format!("`{key}`")) || err.contains(key),
            "{key}: {err}"
        );
        assert!(
            !err.contains("hidden_size") && !err.contains("num_attention_heads"),
            "{key}: {err}"
        );
    }
}

#[test]
fn a_fresh_sinusoidal_table_starts_from_transformers_sinusoids() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), |c| c["sinusoidal_pos_embds"] = true.into());
    let cfg = BertConfig::from_file(&path).unwrap();
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
    let table: Vec<Vec<f32>> = store
        .get("embeddings.position_embeddings.weight")
        .unwrap()
        .as_tensor()
        .to_vec2()
        .unwrap();
    assert_eq!((table.len(), table[0].len()), (40, 32));
    for (p, row) in table.iter().enumerate() {
        for (j, &got) in row.iter().enumerate() {
            let angle = p as f64 / 10_000f64.powf((2 * (j / 2)) as f64 / 32.0);
            let want = if j % 2 == 0 { angle.sin() } else { angle.cos() } as f32;
            assert_eq!(got, want, "position {p}, column {j}");
        }
    }
    // Without the flag the table is drawn from the seed like every other weight.
    let plain = BertConfig::from_file(&fixture("distilbert").join("config.json")).unwrap();
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    BertEncoder::build(&store, "", &plain, &BertOptions::default()).unwrap();
    let drawn: Vec<Vec<f32>> = store
        .get("embeddings.position_embeddings.weight")
        .unwrap()
        .as_tensor()
        .to_vec2()
        .unwrap();
    assert_ne!(drawn[0][1], 1.0);
}

#[test]
fn a_table_read_from_a_file_is_kept_even_when_sinusoidal() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_fixture(dir);
    config(dir, |c| c["sinusoidal_pos_embds"] = true.into());
    let options = LoadOptions::default();
    let flagged = EmbeddingModel::load(dir.to_str().unwrap(), &options).unwrap();
    let plain = EmbeddingModel::load(fixture("distilbert").to_str().unwrap(), &options).unwrap();
    let texts = [
        "In the beginning God created the heaven and the earth.",
        "Jesus wept.",
    ];
    let (a, b) = (
        flagged.embed(&texts, 2).unwrap(),
        plain.embed(&texts, 2).unwrap(),
    );
    assert_eq!(common::max_diff(&a, &b), 0.0);
}

/// `x W^T + b` with the weights `name.weight`, `name.bias` of `w`.
fn linear(x: &Tensor, w: &HashMap<String, Tensor>, name: &str) -> Tensor {
    x.broadcast_matmul(&w[&format!("{name}.weight")].t().unwrap())
        .unwrap()
        .broadcast_add(&w[&format!("{name}.bias")])
        .unwrap()
}

/// LayerNorm over the last axis, epsilon 1e-12.
fn layer_norm(x: &Tensor, w: &HashMap<String, Tensor>, name: &str) -> Tensor {
    let mean = x.mean_keepdim(2).unwrap();
    let centred = x.broadcast_sub(&mean).unwrap();
    let var = centred.sqr().unwrap().mean_keepdim(2).unwrap();
    centred
        .broadcast_div(&(var + 1e-12).unwrap().sqrt().unwrap())
        .unwrap()
        .broadcast_mul(&w[&format!("{name}.weight")])
        .unwrap()
        .broadcast_add(&w[&format!("{name}.bias")])
        .unwrap()
}

#[test]
fn dropout_falls_where_distilbert_puts_it() {
    // transformers' DistilBERT drops out the embeddings (after their LayerNorm), the
    // attention probabilities and the feed-forward's output, never the attention's output
    // projection (BERT's does). With dropout 0.5 and attention_dropout 0, the hidden
    // states of a training forward equal the block written out here with the crate's
    // masks (embeddings: layer 0, site 0; layer i's feed-forward: layer i + 1, site 3).
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_fixture(dir);
    config(dir, |c| {
        c["dropout"] = 0.5.into();
        c["attention_dropout"] = 0.0.into();
    });
    let model = EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let texts = [
        "In the beginning God created the heaven and the earth.",
        "Jesus wept.",
    ];
    let batch = model.tokenizer().encode(&texts, &Device::Cpu).unwrap();
    let ctx = common::train_ctx(0);
    let bert = model.encoder().tower().detached_model();
    let got = bert.hidden_states(&batch, &ctx).unwrap();

    let w = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let drop = |x: &Tensor, layer: u32, site: u32| {
        gradcache::nn::dropout(x, ctx.mask_seed(layer, site).unwrap(), 0.5).unwrap()
    };
    let (n, s) = batch.input_ids.dims2().unwrap();
    let words = w["embeddings.word_embeddings.weight"]
        .index_select(&batch.input_ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((n, s, 32))
        .unwrap();
    let positions = w["embeddings.position_embeddings.weight"]
        .narrow(0, 0, s)
        .unwrap();
    let x = words.broadcast_add(&positions).unwrap();
    let mut x = drop(&layer_norm(&x, &w, "embeddings.LayerNorm"), 0, 0);
    let mask = batch.attention_mask.to_dtype(DType::F32).unwrap();
    let bias = ((mask - 1.0).unwrap() * 10_000.0)
        .unwrap()
        .reshape((n, 1, 1, s))
        .unwrap();
    let heads = |t: Tensor| {
        t.reshape((n, s, 4, 8))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    for i in 0..2 {
        let l = format!("transformer.layer.{i}");
        let q = heads(linear(&x, &w, &format!("{l}.attention.q_lin")));
        let k = heads(linear(&x, &w, &format!("{l}.attention.k_lin")));
        let v = heads(linear(&x, &w, &format!("{l}.attention.v_lin")));
        let scores = (q.matmul(&k.t().unwrap()).unwrap() / 8f64.sqrt())
            .unwrap()
            .broadcast_add(&bias)
            .unwrap();
        let probs = candle_nn::ops::softmax_last_dim(&scores).unwrap();
        let context = probs
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((n, s, 32))
            .unwrap();
        let attended = linear(&context, &w, &format!("{l}.attention.out_lin"));
        let h = layer_norm(&(attended + &x).unwrap(), &w, &format!("{l}.sa_layer_norm"));
        let up = linear(&h, &w, &format!("{l}.ffn.lin1")).gelu_erf().unwrap();
        let down = drop(&linear(&up, &w, &format!("{l}.ffn.lin2")), i + 1, 3);
        x = layer_norm(&(down + &h).unwrap(), &w, &format!("{l}.output_layer_norm"));
    }
    // The real tokens' states (a padded position's state is never read).
    let real = batch
        .attention_mask
        .to_dtype(DType::F32)
        .unwrap()
        .unsqueeze(2)
        .unwrap();
    let err = common::max_diff(
        &got.broadcast_mul(&real).unwrap(),
        &x.broadcast_mul(&real).unwrap(),
    );
    assert!(err <= 1e-5, "hidden states differ by {err:e}");
    // And the masks act: evaluation gives other states.
    let eval = bert.hidden_states(&batch, &gradcache::Ctx::eval()).unwrap();
    assert!(common::max_diff(&got, &eval) > 1e-2);
}
