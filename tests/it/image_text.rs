//! Image-text training: CLIP's loss with a learnable temperature under the gradient cache
//! (two towers of different kinds, their own chunk sizes), the trainer's exact resume
//! with BatchNorm state, the export, and bad configurations.

use crate::common;

use std::path::Path;

use crate::common::{bits, random};
use candle_core::{DType, Device, Tensor};
use gradcache::lstm::{Lstm, LstmConfig, LstmEncoder, LstmPooling};
use gradcache::resnet::{Block, ResNet, ResNetConfig};
use gradcache::train::image_text::{
    export_image_text, ImageTextConfig, ImageTextTrainer, LOGIT_SCALE,
};
use gradcache::{
    ClipLoss, Encoder, GradCache, ParamStore, Recompute, Recomputed, TokenBatch, Tower,
};

fn tokens(rows: usize, steps: usize) -> TokenBatch {
    let ids: Vec<u32> = (0..rows * steps)
        .map(|i| 1 + (i as u32 * 31) % 40)
        .collect();
    let ids = Tensor::from_vec(ids, (rows, steps), &Device::Cpu).unwrap();
    TokenBatch::new(
        ids.clone(),
        ids.ones_like().unwrap(),
        ids.zeros_like().unwrap(),
    )
    .unwrap()
}

#[test]
fn a_cached_clip_step_with_a_resnet_and_an_lstm_equals_the_chunkwise_reference() {
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let resnet = ResNetConfig {
        in_channels: 3,
        width: 4,
        stages: vec![1, 1],
        block: Block::Basic,
        output: 6,
    };
    let lstm = LstmConfig {
        vocab_size: 41,
        embedding_size: 5,
        hidden_size: 6,
        num_layers: 1,
        pooling: LstmPooling::Mean,
        output: 6,
    };
    let image = Tower::build(&store, "image", |vb| ResNet::new(&resnet, vb)).unwrap();
    let image = Recomputed::new(image, Recompute::EveryLayer).unwrap();
    let text = Tower::build(&store, "text", |vb| Lstm::new(&lstm, vb)).unwrap();
    let text = LstmEncoder::new(text, Recompute::Sqrt).unwrap();
    let loss = ClipLoss::new(&store, LOGIT_SCALE, 0.07, 100.0).unwrap();
    // BatchNorm makes the image chunk part of the model: the reference below normalises
    // the same chunks of 4 images; the text tower has no batch statistics, so its chunk
    // size (3) is free.
    let gc = GradCache::two_towers(image, text, 4, 3, loss).unwrap();
    assert!(
        gc.params().get(LOGIT_SCALE).is_some(),
        "the temperature is trained"
    );
    let images = random(5, &[8, 3, 8, 8]);
    let captions = tokens(8, 7);
    let out = gc.cache_step(0, &images, &captions).unwrap();
    assert_eq!(
        out.grads.len(),
        gc.params().len(),
        "every parameter gets a gradient"
    );

    // Reference: each image chunk through the graph forward (as the representation pass
    // chunks them), all captions at once, CLIP's loss, one backward.
    let fresh = ParamStore::new(3, DType::F32, &Device::Cpu);
    let image = Tower::build(&fresh, "image", |vb| ResNet::new(&resnet, vb)).unwrap();
    let image = Recomputed::new(image, Recompute::Off).unwrap();
    let text = Tower::build(&fresh, "text", |vb| Lstm::new(&lstm, vb)).unwrap();
    let text = LstmEncoder::new(text, Recompute::Off).unwrap();
    let loss = ClipLoss::new(&fresh, LOGIT_SCALE, 0.07, 100.0).unwrap();
    let reference = GradCache::two_towers(image, text, 4, 8, loss).unwrap();
    let side = |c: usize| reference.ctx(0, gradcache::Side::Query, c).updating_stats();
    let q = Tensor::cat(
        &[
            reference
                .query_encoder()
                .forward(&images.narrow(0, 0, 4).unwrap(), &side(0))
                .unwrap(),
            reference
                .query_encoder()
                .forward(&images.narrow(0, 4, 4).unwrap(), &side(1))
                .unwrap(),
        ],
        0,
    )
    .unwrap();
    let p = reference
        .passage_encoder()
        .forward(&captions, &reference.ctx(0, gradcache::Side::Passage, 0))
        .unwrap();
    let value = gradcache::Loss::forward(reference.loss(), &q, &p).unwrap();
    let want_loss = value.to_scalar::<f32>().unwrap();
    let want = reference.params().grads_from(&value.backward().unwrap());
    assert!((out.loss - want_loss).abs() <= 1e-5 * want_loss.abs());
    let err = out.grads.max_rel_err(&want, 1e-4).unwrap();
    assert!(err <= 1e-5, "relative gradient error {err}");
    let g = out.grads.get(LOGIT_SCALE).unwrap();
    assert!(common::max_abs(g) > 0.0, "the logit scale gets a gradient");
}

#[test]
fn the_logit_scale_starts_at_one_over_the_temperature_and_is_clamped_as_clip_does() {
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    let loss = ClipLoss::new(&store, LOGIT_SCALE, 0.07, 100.0).unwrap();
    assert!((loss.scale().unwrap() - 1.0 / 0.07).abs() < 1e-3);
    let var = store.get(LOGIT_SCALE).unwrap();
    var.set(&Tensor::new(9f32, &Device::Cpu).unwrap()).unwrap();
    loss.clamp().unwrap();
    assert!((loss.scale().unwrap() - 100.0).abs() < 1e-3);
    var.set(&Tensor::new(-2f32, &Device::Cpu).unwrap()).unwrap();
    loss.clamp().unwrap();
    assert!((loss.scale().unwrap() - 1.0).abs() < 1e-6);
    for (t, m, key) in [(0.0, 100.0, "temperature"), (0.07, 0.5, "max_logit_scale")] {
        let err = ClipLoss::new(&store, "other", t, m).err().unwrap();
        assert!(err.to_string().contains(key), "{err}");
    }
}

/// A run small enough for a test: 16x16 images, a 2-stage ResNet of width 4, an LSTM.
fn tiny(dir: &Path, extra: &[&str]) -> ImageTextConfig {
    let mut set: Vec<String> = [
        "data.image_size=16",
        "data.train=64",
        "data.eval=12",
        "image.width=4",
        "image.stages=[1, 1]",
        "image.recompute=\"every_layer\"",
        "text.kind=\"lstm\"",
        "text.hidden_size=8",
        "text.num_layers=1",
        "text.max_len=14",
        "text.recompute=\"sqrt\"",
        "train.steps=4",
        "train.batch_size=16",
        "train.image_chunk=8",
        "train.text_chunk=5",
        "train.eval_every=0",
        "train.checkpoint_every=2",
        "optim.warmup_ratio=0.0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    set.push(format!("output_dir=\"{}\"", dir.display()));
    set.extend(extra.iter().map(|s| s.to_string()));
    ImageTextConfig::load(Path::new("configs/image-text.toml"), &set).unwrap()
}

fn state_bits(t: &ImageTextTrainer) -> Vec<(String, Vec<u32>)> {
    let mut all: Vec<_> = t
        .state()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.to_string(), bits(v.as_tensor())))
        .collect();
    for (n, v) in t.optimizer_state().unwrap() {
        all.push((n, bits(&v)));
    }
    all
}

#[test]
fn resuming_from_a_checkpoint_continues_bit_for_bit_with_batch_norm_state() {
    let dir = tempfile::tempdir().unwrap();
    let straight = {
        let mut t = ImageTextTrainer::new(tiny(&dir.path().join("a"), &[]), None).unwrap();
        for _ in 0..4 {
            t.train_step().unwrap();
        }
        state_bits(&t)
    };
    let cfg = tiny(&dir.path().join("b"), &[]);
    let ckpt = {
        let mut t = ImageTextTrainer::new(cfg.clone(), None).unwrap();
        t.train_step().unwrap();
        t.train_step().unwrap();
        t.save_checkpoint().unwrap()
    };
    let mut resumed = ImageTextTrainer::new(cfg, Some(&ckpt)).unwrap();
    assert_eq!(resumed.step(), 2);
    resumed.train_step().unwrap();
    resumed.train_step().unwrap();
    let got = state_bits(&resumed);
    assert_eq!(got.len(), straight.len());
    let running = got.iter().filter(|(n, _)| n.contains("running_")).count();
    assert!(
        running >= 2 * 5,
        "BatchNorm statistics are part of the state ({running})"
    );
    assert!(got.iter().any(|(n, _)| n == LOGIT_SCALE));
    for ((name, a), (_, b)) in got.iter().zip(&straight) {
        assert!(a == b, "{name} differs after resuming");
    }
    // Another configuration does not resume.
    let other = tiny(&dir.path().join("c"), &["train.image_chunk=4"]);
    let err = ImageTextTrainer::new(other, Some(&ckpt)).err().unwrap();
    assert!(err.to_string().contains("another configuration"), "{err}");
}

#[test]
fn the_export_holds_both_towers_with_their_running_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = ImageTextTrainer::new(tiny(dir.path(), &["train.steps=2"]), None).unwrap();
    let (before, after) = t.run(&mut gradcache::train::Quiet).unwrap();
    assert!(before.is_some());
    assert_eq!(after.queries, 12);
    let model = dir.path().join("model");
    let image = candle_core::safetensors::load(model.join("image_tower.safetensors"), &Device::Cpu)
        .unwrap();
    for name in [
        "conv1.weight",
        "bn1.running_mean",
        "layer2.0.downsample.1.running_var",
        "fc.weight",
    ] {
        let stored = t.store().get(&format!("image.{name}")).unwrap();
        assert_eq!(bits(&image[name]), bits(stored.as_tensor()), "{name}");
    }
    let moved = t.store().get("image.bn1.running_var").unwrap();
    assert!(common::max_diff(moved.as_tensor(), &moved.as_tensor().ones_like().unwrap()) > 1e-4);
    let text =
        candle_core::safetensors::load(model.join("text_tower.safetensors"), &Device::Cpu).unwrap();
    assert!(text.contains_key("lstm.weight_ih_l0"));
    assert!(model.join("tokenizer.json").is_file());
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("image_text_config.json")).unwrap(),
    )
    .unwrap();
    assert!(meta["logit_scale"].as_f64().unwrap() > 1.0);
    assert!(dir.path().join("checkpoints/step-00000002").is_dir());

    // `gradcache export` of the run's last checkpoint writes the same towers.
    let cfg = tiny(dir.path(), &["train.steps=2"]);
    let again = dir.path().join("again");
    let step = export_image_text(&cfg, None, &again).unwrap();
    assert_eq!(step, 2);
    for file in ["image_tower.safetensors", "text_tower.safetensors"] {
        let a = candle_core::safetensors::load(model.join(file), &Device::Cpu).unwrap();
        let b = candle_core::safetensors::load(again.join(file), &Device::Cpu).unwrap();
        assert_eq!(a.len(), b.len());
        for (name, t) in &a {
            assert_eq!(bits(t), bits(&b[name]), "{file}: {name}");
        }
    }
    let err = export_image_text(&cfg, None, &again).unwrap_err();
    assert!(
        err.to_string().contains(&again.display().to_string()),
        "{err}"
    );
}

#[test]
fn bad_image_text_configurations_are_refused_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["output_dir=\"/tmp/x\""];
    for (set, key) in [
        ("train.image_chunk=1", "train.image_chunk"),
        ("train.batch_size=33", "train.image_chunk"),
        ("data.train=8", "data.train"),
        ("text.num_heads=5", "text.num_heads"),
        ("image.stages=[]", "image.stages"),
        ("data.image_size=8", "shapes.size"),
        ("train.steps=0", "train.steps"),
        ("train.batch_size=1", "train.batch_size"),
        ("train.text_chunk=0", "train.text_chunk"),
        ("data.eval=1", "data.eval"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints"),
        ("text.max_len=2", "text"),
        ("image.width=0", "image.width"),
        ("optim.lr=0", "optim.lr"),
        ("image.recompute=\"attention\"", "recompute"),
        ("loss.temperature=0", "loss.temperature"),
    ] {
        let mut all: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        all.push(set.to_string());
        let err = match ImageTextConfig::load(Path::new("configs/image-text.toml"), &all) {
            Err(e) => e,
            Ok(cfg) => ImageTextTrainer::new(cfg, None).err().unwrap(),
        };
        assert!(err.to_string().contains(key), "{set}: {err}");
    }
    let err = ImageTextConfig::load(
        Path::new("configs/image-text.toml"),
        &["train.bogus=1".to_string()],
    )
    .unwrap_err();
    assert!(err.to_string().contains("bogus"), "{err}");
    assert!(!dir.path().join("x").exists());
}

#[test]
fn the_shipped_config_scaled_down_learns_held_out_compositions() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(
        dir.path(),
        &[
            "data.train=1024",
            "data.eval=64",
            "image.width=8",
            "text.hidden_size=32",
            "train.steps=40",
            "train.batch_size=32",
            "train.image_chunk=16",
            "train.text_chunk=32",
            "train.checkpoint_every=0",
            "optim.lr=3e-3",
        ],
    );
    let mut t = ImageTextTrainer::new(cfg, None).unwrap();
    let (before, after) = t.run(&mut gradcache::train::Quiet).unwrap();
    let before = before.unwrap();
    assert!(
        // Measured: recall@1 0.031 -> 0.344, recall@5 0.109 -> 0.938 (40 steps of 32).
        after.recall_at_1 >= before.recall_at_1 + 0.15
            && after.recall_at_5 >= before.recall_at_5 + 0.4,
        "held-out image->text recall@1 {:.3} -> {:.3}, recall@5 {:.3} -> {:.3}",
        before.recall_at_1,
        after.recall_at_1,
        before.recall_at_5,
        after.recall_at_5
    );
}

#[test]
fn a_checkpoint_whose_data_position_is_not_its_steps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), &[]);
    let ckpt = {
        let mut t = ImageTextTrainer::new(cfg.clone(), None).unwrap();
        t.train_step().unwrap();
        t.save_checkpoint().unwrap()
    };
    let state = ckpt.join("trainer_state.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    v["data"]["offset"] = 3.into();
    std::fs::write(&state, v.to_string()).unwrap();
    let err = ImageTextTrainer::new(cfg, Some(&ckpt))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("data position"), "{err}");
}

/// The tiny run with a DenseNet-BC image tower (growth 4, blocks [2, 2], memory-efficient).
fn tiny_densenet(dir: &Path) -> ImageTextConfig {
    use gradcache::train::image_text::{DenseNetSettings, ImageArch, ImageTower};
    let mut cfg = tiny(dir, &[]);
    cfg.image = ImageTower {
        arch: ImageArch::Densenet,
        densenet: Some(DenseNetSettings {
            growth_rate: 4,
            block_config: vec![2, 2],
            init_features: 8,
            ..DenseNetSettings::default()
        }),
        recompute: cfg.image.recompute.clone(),
        ..ImageTower::default()
    };
    cfg
}

#[test]
fn a_densenet_image_tower_trains_resumes_bit_for_bit_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let straight = {
        let mut t = ImageTextTrainer::new(tiny_densenet(&dir.path().join("a")), None).unwrap();
        for _ in 0..4 {
            assert!(t.train_step().unwrap().loss.is_finite());
        }
        state_bits(&t)
    };
    let cfg = tiny_densenet(&dir.path().join("b"));
    let ckpt = {
        let mut t = ImageTextTrainer::new(cfg.clone(), None).unwrap();
        t.train_step().unwrap();
        t.train_step().unwrap();
        t.save_checkpoint().unwrap()
    };
    let mut resumed = ImageTextTrainer::new(cfg.clone(), Some(&ckpt)).unwrap();
    resumed.train_step().unwrap();
    resumed.train_step().unwrap();
    let got = state_bits(&resumed);
    assert_eq!(got.len(), straight.len());
    assert!(got
        .iter()
        .any(|(n, _)| n == "image.features.denseblock2.denselayer2.norm1.running_var"));
    for ((name, a), (_, b)) in got.iter().zip(&straight) {
        assert!(a == b, "{name} differs after resuming");
    }
    // The export holds the DenseNet under torchvision's names.
    let out = dir.path().join("model");
    export_image_text(&cfg, None, &out).unwrap();
    let image =
        candle_core::safetensors::load(out.join("image_tower.safetensors"), &Device::Cpu).unwrap();
    for name in [
        "features.conv0.weight",
        "features.transition1.conv.weight",
        "features.norm5.running_mean",
        "classifier.weight",
    ] {
        assert!(image.contains_key(name), "{name}");
    }
    // Sizes that do not fit, each refused by its key.
    for (edit, key) in [
        (
            &(|c: &mut ImageTextConfig| c.image.width = 8) as &dyn Fn(&mut ImageTextConfig),
            "image.width",
        ),
        (
            &|c: &mut ImageTextConfig| c.image.densenet.as_mut().unwrap().block_config = vec![2, 0],
            "densenet.block_config",
        ),
        (
            &|c: &mut ImageTextConfig| c.image.densenet.as_mut().unwrap().growth_rate = 0,
            "densenet.growth_rate",
        ),
        (
            &|c: &mut ImageTextConfig| c.image.densenet.as_mut().unwrap().block_config = vec![1; 6],
            "data.image_size",
        ),
        (
            &|c: &mut ImageTextConfig| c.image.arch = Default::default(),
            "image.densenet",
        ),
    ] {
        let mut bad = tiny_densenet(&dir.path().join("bad"));
        edit(&mut bad);
        let err = ImageTextTrainer::new(bad, None).err().unwrap();
        assert!(err.to_string().contains(key), "{key}: {err}");
        assert!(!dir.path().join("bad").exists());
    }
}
