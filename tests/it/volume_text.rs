//! Volume-text training: a VNet volume tower against the captions of the generated
//! Solids, through the image-text loop: `configs/volume-text.toml` scaled down learns the
//! held-out compositions, a run resumes bit for bit with its BatchNorm state (plain and
//! memory-efficient units, checkpointed stages) and exports the volume tower under
//! vnet.pytorch's names; bad configurations are refused by key before anything is written.

use std::path::Path;

use crate::common::bits;
use candle_core::Device;
use gradcache::train::image_text::{export_image_text, ImageTextConfig, ImageTextTrainer};

/// `configs/volume-text.toml` scaled down for a test, writing to `dir`.
fn tiny(dir: &Path, extra: &[&str]) -> ImageTextConfig {
    let mut set: Vec<String> = [
        "data.train=64",
        "data.eval=12",
        "volume.vnet.width=4",
        "volume.vnet.kernel=3",
        "text.hidden_size=16",
        "text.num_layers=1",
        "text.intermediate_size=32",
        "train.steps=4",
        "train.batch_size=8",
        "train.volume_chunk=4",
        "train.text_chunk=8",
        "train.eval_every=0",
        "train.checkpoint_every=2",
        "optim.warmup_ratio=0.0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    set.push(format!("output_dir=\"{}\"", dir.display()));
    set.extend(extra.iter().map(|s| s.to_string()));
    ImageTextConfig::load(Path::new("configs/volume-text.toml"), &set).unwrap()
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
fn the_shipped_config_scaled_down_learns_held_out_compositions() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(
        dir.path(),
        &[
            "data.train=512",
            "data.eval=64",
            "train.steps=60",
            "train.batch_size=32",
            "train.volume_chunk=16",
            "train.text_chunk=32",
            "train.checkpoint_every=0",
            "optim.lr=3e-3",
        ],
    );
    let mut t = ImageTextTrainer::new(cfg, None).unwrap();
    let (before, after) = t.run(&mut gradcache::train::Quiet).unwrap();
    let before = before.unwrap();
    assert!(
        // Measured: recall@1 0.078 -> 0.250, recall@5 0.203 -> 0.594 (60 steps of 32).
        after.recall_at_1 >= before.recall_at_1 + 0.1
            && after.recall_at_5 >= before.recall_at_5 + 0.25,
        "held-out volume->text recall@1 {:.3} -> {:.3}, recall@5 {:.3} -> {:.3}",
        before.recall_at_1,
        after.recall_at_1,
        before.recall_at_5,
        after.recall_at_5
    );
}

#[test]
fn a_volume_text_run_resumes_bit_for_bit_and_exports_the_vnet() {
    for (memory_efficient, recompute) in [("false", "off"), ("true", "every_layer")] {
        let dir = tempfile::tempdir().unwrap();
        let extra = [
            format!("volume.vnet.memory_efficient={memory_efficient}"),
            format!("volume.recompute=\"{recompute}\""),
        ];
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let straight = {
            let mut t = ImageTextTrainer::new(tiny(&dir.path().join("a"), &extra), None).unwrap();
            for _ in 0..4 {
                assert!(t.train_step().unwrap().loss.is_finite());
            }
            state_bits(&t)
        };
        let cfg = tiny(&dir.path().join("b"), &extra);
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
            .any(|(n, _)| n == "image.down_tr16.ops.1.bn1.running_var"));
        for ((name, a), (_, b)) in got.iter().zip(&straight) {
            assert!(
                a == b,
                "{memory_efficient}/{recompute}: {name} differs after resuming"
            );
        }
        let out = dir.path().join("model");
        export_image_text(&cfg, None, &out).unwrap();
        let volume =
            candle_core::safetensors::load(out.join("volume_tower.safetensors"), &Device::Cpu)
                .unwrap();
        for name in [
            "in_tr.conv1.weight",
            "down_tr8.down_conv.weight",
            "down_tr16.relu2.weight",
            "down_tr16.ops.0.bn1.running_mean",
            "fc.weight",
        ] {
            let stored = resumed.store().get(&format!("image.{name}"));
            assert!(volume.contains_key(name) && stored.is_some(), "{name}");
        }
    }
}

#[test]
fn bad_volume_text_configurations_are_refused_by_key_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let load = |set: &[&str]| {
        let mut all: Vec<String> = vec![format!("output_dir=\"{}\"", out.display())];
        all.extend(set.iter().map(|s| s.to_string()));
        ImageTextConfig::load(Path::new("configs/volume-text.toml"), &all)
    };
    for (set, key) in [
        (&["volume.arch=\"resnet\""][..], "volume.arch"),
        (&["task=\"image-text\""][..], "volume.arch"),
        (&["data.volume_size=18"][..], "data.volume_size"),
        (&["data.volume_size=8"][..], "data.volume_size"),
        (&["volume.vnet.stages=[]"][..], "vnet.stages"),
        (&["volume.vnet.stages=[1, 0]"][..], "vnet.stages"),
        (&["volume.vnet.kernel=4"][..], "vnet.kernel"),
        (&["volume.vnet.width=0"][..], "vnet"),
        (&["volume.width=8"][..], "volume.width"),
        (&["volume.vnet.depth=3"][..], "depth"),
    ] {
        let err = load(set)
            .err()
            .unwrap_or_else(|| panic!("{set:?} accepted"));
        assert!(err.to_string().contains(key), "{set:?}: {err}");
    }
    // A VNet's sizes in an image-text run.
    let err = ImageTextConfig::load(
        Path::new("configs/image-text.toml"),
        &["image.vnet.width=8".to_string()],
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("image.vnet"), "{err}");
    assert!(!out.exists(), "nothing written");
}
