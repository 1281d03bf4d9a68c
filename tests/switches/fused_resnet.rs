//! The ResNet's CPU nodes against the composed candle ops they replace: the convolution
//! (its faster backward) and BatchNorm in training (forward, backward, running
//! statistics). One test in its own binary: it switches the fused kernels for the whole
//! process.

use crate::common;

use crate::common::{random, train_ctx};
use candle_core::{DType, Device, Tensor};
use gradcache::{ParamStore, Params};

#[test]
fn convolution_and_batch_norm_nodes_equal_the_composed_ops() {
    let _switches = crate::switching();
    convolution_node_has_candles_gradients();
    fused_batch_norm_matches_the_composed_one();
}

fn convolution_node_has_candles_gradients() {
    use candle_core::Var;
    // (kernel, stride, input side, images, channels): 3x3 and 1x1, strides 1 and 2, even
    // and odd sides, ResNet-sized ones, and inputs whose im2col columns exceed the node's
    // 32 MiB (run in pieces of 1 and of 6 rows).
    for (k, stride, side, n, c) in [
        (3, 1, 8, 3, 4),
        (3, 2, 8, 3, 4),
        (3, 2, 7, 3, 4),
        (1, 2, 7, 3, 4),
        (1, 1, 5, 3, 4),
        (3, 1, 32, 7, 64),
        (3, 2, 32, 7, 64),
        (3, 1, 64, 9, 128),
        (3, 2, 64, 9, 128),
    ] {
        let x = Var::from_tensor(&random(51, &[n, c, side, side])).unwrap();
        let w = Var::from_tensor(&random(52, &[5, c, k, k])).unwrap();
        let dy_seed = 53;
        let grads = |fused: bool| {
            gradcache::nn::set_fused_kernels(fused);
            let y = gradcache::nn::conv2d(x.as_tensor(), w.as_tensor(), k / 2, stride).unwrap();
            gradcache::nn::set_fused_kernels(true);
            let dy = random(dy_seed, y.dims());
            let store = (y * dy).unwrap().sum_all().unwrap().backward().unwrap();
            (
                store.get(x.as_tensor()).unwrap().clone(),
                store.get(w.as_tensor()).unwrap().clone(),
            )
        };
        let (dx, dw) = grads(true);
        let (want_dx, want_dw) = grads(false);
        let rel = |a: &Tensor, b: &Tensor| common::max_diff(a, b) / common::max_abs(b);
        assert!(
            rel(&dx, &want_dx) < 1e-5,
            "k {k} stride {stride} side {side}: dx"
        );
        assert!(
            rel(&dw, &want_dw) < 1e-5,
            "k {k} stride {stride} side {side}: dw"
        );
    }
}

fn fused_batch_norm_matches_the_composed_one() {
    use candle_core::Var;
    use gradcache::nn::BatchNorm;
    for (dims, relu) in [
        (vec![6, 4, 5, 3], false),
        (vec![6, 4, 5, 3], true),
        (vec![7, 4], false),
    ] {
        let x = Var::from_tensor(&random(61, &dims).affine(3.0, 0.5).unwrap()).unwrap();
        let dy = random(62, &dims);
        // Each form in a store of its own (same seed: same weights and statistics).
        let run = |fused: bool| {
            let store = ParamStore::new(9, DType::F32, &Device::Cpu);
            let bn = BatchNorm::new(4, store.var_builder().pp("bn")).unwrap();
            gradcache::nn::set_fused_kernels(fused);
            let ctx = train_ctx(0).updating_stats();
            let y = if relu {
                bn.forward_relu(x.as_tensor(), &ctx)
            } else {
                bn.forward(x.as_tensor(), &ctx)
            };
            gradcache::nn::set_fused_kernels(true);
            let y = y.unwrap();
            let g = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
            let (params, buffers): (Vec<_>, Vec<_>) = store
                .params()
                .iter()
                .map(|(n, v)| (n.to_string(), v.clone()))
                .partition(|(n, _)| !n.contains("running"));
            let mut grads = Params::new(params).grads_from(&g);
            let dx = g.get(x.as_tensor()).unwrap().clone();
            grads
                .accumulate(gradcache::Gradients::from_iter([("x".to_string(), dx)]))
                .unwrap();
            (y, grads, Params::new(buffers))
        };
        let (y, got, stats) = run(true);
        let (want_y, want, want_stats) = run(false);
        assert!(
            common::max_diff(&y, &want_y) < 1e-5,
            "{dims:?} relu {relu}: output"
        );
        assert_eq!(got.len(), 3, "x, weight and bias get gradients");
        let err = got.max_rel_err(&want, 1e-4).unwrap();
        assert!(
            err < 1e-5,
            "{dims:?} relu {relu}: relative gradient error {err}"
        );
        for ((name, a), (_, b)) in stats.iter().zip(want_stats.iter()) {
            let diff = common::max_diff(a.as_tensor(), b.as_tensor());
            assert!(diff < 1e-5, "{dims:?}: {name} differs by {diff}");
            assert!(
                common::max_diff(a.as_tensor(), &a.as_tensor().ones_like().unwrap()) > 1e-3
                    || name.ends_with("running_mean"),
                "{name} moved"
            );
        }
    }
}
