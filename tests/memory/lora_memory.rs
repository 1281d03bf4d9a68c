//! A LoRA model's weights are held once: the store's variables (the frozen base in its
//! narrowed dtype), with no full-width copy in either build of the tower (the graph one and
//! the detached one). The counting allocator is process-wide: the test holds the binary's
//! lock (`main.rs`).

use candle_core::{DType, Device};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::memory::current_bytes;
use gradcache::nn::lora::LoraSpec;
use gradcache::params::Freeze;
use gradcache::ParamStore;

use crate::alone;

#[test]
fn a_lora_tower_holds_its_weights_once_in_their_stored_dtype() {
    let _alone = alone();
    // A decoder of a few wide layers: the projections dominate the weights.
    let mut cfg = BertConfig::new(512, 256, 2, 4, 768, 64);
    cfg.model_type = Some("qwen3".into());
    cfg.hidden_act = "silu".into();
    cfg.extra.insert("num_key_value_heads".into(), 2.into());
    let spec = LoraSpec {
        rank: 8,
        alpha: 16.0,
        targets: vec![],
        rslora: false,
        dropout: 0.0,
    };
    for narrow in [DType::F32, DType::BF16] {
        let before = current_bytes();
        let store = ParamStore::new(3, DType::F32, &Device::Cpu).with_frozen(
            Freeze::default()
                .all_but_adapters()
                .narrowing(narrow, &spec.targets),
        );
        let options = BertOptions {
            pooling: Pooling::LastToken,
            lora: Some(spec.clone()),
            ..Default::default()
        };
        let encoder = BertEncoder::build(&store, "", &cfg, &options).unwrap();
        let held = current_bytes() - before;
        let stored: usize = store
            .params()
            .iter()
            .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
            .sum();
        let narrowed = store
            .params()
            .iter()
            .filter(|(_, v)| v.dtype() == DType::BF16)
            .count();
        assert_eq!(narrowed > 0, narrow == DType::BF16);
        // The variables, and little besides (the rotary tables, names, small buffers).
        assert!(
            held as f64 <= stored as f64 * 1.1,
            "{narrow:?}: the tower holds {held} bytes for {stored} bytes of weights"
        );
        drop(encoder);
    }
}
