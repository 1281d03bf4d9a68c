//! `Tower`: the graph-free forward records no op and shares storage with the trainable
//! variables (an optimizer update is visible to it); the graph forward records the graph;
//! a tower owns exactly the parameters its model asked for.

use candle_core::{DType, Device, Tensor};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{Ctx, Encoder, ParamStore, Tower};

fn cfg() -> MlpConfig {
    MlpConfig {
        input: 4,
        hidden: 8,
        output: 3,
        dropout: 0.0,
    }
}

#[test]
fn encode_is_graph_free_and_forward_records_the_graph() {
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| Mlp::new(&cfg(), vb)).unwrap();
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    let encoded = tower.encode(&x, &Ctx::eval()).unwrap();
    let forward = tower.forward(&x, &Ctx::eval()).unwrap();
    assert!(
        !encoded.track_op(),
        "the representation pass must not record a graph"
    );
    assert!(
        forward.track_op(),
        "the graph forward must record the graph"
    );
    let (a, b) = (
        encoded.to_vec2::<f32>().unwrap(),
        forward.to_vec2::<f32>().unwrap(),
    );
    assert_eq!(a, b, "both instances compute the same function");
}

#[test]
fn detached_weights_see_optimizer_updates() {
    let store = ParamStore::new(2, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| Mlp::new(&cfg(), vb)).unwrap();
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    let before = tower
        .encode(&x, &Ctx::eval())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let bias = store.get("out.bias").unwrap();
    bias.set(&(bias.as_tensor() + 1.0).unwrap()).unwrap();
    let after = tower
        .encode(&x, &Ctx::eval())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (b, a) in before.iter().flatten().zip(after.iter().flatten()) {
        assert!(
            (a - b - 1.0).abs() < 1e-6,
            "the update must show through: {b} -> {a}"
        );
    }
}

#[test]
fn towers_own_exactly_their_parameters() {
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let q = Tower::build(&store, "query", |vb| Mlp::new(&cfg(), vb)).unwrap();
    let p = Tower::build(&store, "passage", |vb| Mlp::new(&cfg(), vb)).unwrap();
    assert_eq!(store.params().len(), 16);
    let names: Vec<&str> = q.params().names().collect();
    assert_eq!(names.len(), 8);
    assert!(names.iter().all(|n| n.starts_with("query.")), "{names:?}");
    assert!(p.params().names().all(|n| n.starts_with("passage.")));
    // Same seed, same names: identical initial weights, whatever the build order.
    let again = ParamStore::new(3, DType::F32, &Device::Cpu);
    Tower::build(&again, "passage", |vb| Mlp::new(&cfg(), vb)).unwrap();
    let w = |s: &ParamStore| {
        s.get("passage.fc1.weight")
            .unwrap()
            .as_tensor()
            .to_vec2::<f32>()
            .unwrap()
    };
    assert_eq!(w(&store), w(&again));
}
