//! The differentiable layers compute what candle's own (fused or plain) versions compute,
//! and gradients reach their parameters.

use candle_core::{Var, D};
use gradcache::nn::{layer_norm, linear};

use crate::common::{max_diff, random};

#[test]
fn linear_equals_x_times_w_transposed_plus_b() {
    let (x, w, b) = (random(1, &[2, 5, 6]), random(2, &[4, 6]), random(3, &[4]));
    let want = x
        .broadcast_matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap();
    let got = linear(&x, &w, Some(&b)).unwrap();
    assert_eq!(got.dims(), &[2, 5, 4]);
    assert!(max_diff(&got, &want) < 1e-5);
}

#[test]
fn layer_norm_matches_candle_and_passes_gradients() {
    let x = random(4, &[3, 8]);
    let w = Var::from_tensor(&random(5, &[8])).unwrap();
    let b = Var::from_tensor(&random(6, &[8])).unwrap();
    let got = layer_norm(&x, w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
    let want = candle_nn::ops::layer_norm(&x, w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
    assert!(max_diff(&got, &want) < 1e-5);

    let grads = got.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for (name, v) in [("weight", &w), ("bias", &b)] {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert!(
            g.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }
    // The fused op would have cut the graph: this is why the composed version exists.
    let fused = candle_nn::ops::layer_norm(&x, w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
    let cut = fused
        .sum_keepdim(D::Minus1)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(
        cut.get(w.as_tensor()).is_none(),
        "candle's fused layer norm now has a backward"
    );
}
