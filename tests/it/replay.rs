//! The replay primitive returns the vector-Jacobian product `J^T g` for the parameters and
//! (when asked) the input, checked against the closed form of an affine map.

use candle_core::{DType, Device, Tensor, Var};
use gradcache::replay::{replay, replay_with_input};
use gradcache::{Params, Result};

fn close(a: &Tensor, b: &Tensor) -> bool {
    let d = a
        .sub(b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    d.to_scalar::<f32>().unwrap() < 1e-5
}

fn setup() -> (Params, Var, Var, Var, Tensor, Tensor) {
    let dev = &Device::Cpu;
    let r = |seed, shape: (usize, usize)| {
        gradcache::rng::normal(seed, 0.0, 1.0, &shape.into(), DType::F32, dev).unwrap()
    };
    let w = Var::from_tensor(&r(1, (4, 3))).unwrap();
    let b = Var::from_tensor(&r(2, (1, 3))).unwrap();
    let unused = Var::from_tensor(&r(3, (2, 2))).unwrap();
    let params = Params::new([
        ("w".to_string(), w.clone()),
        ("b".to_string(), b.clone()),
        ("unused".to_string(), unused.clone()),
    ]);
    (params, w, b, unused, r(4, (5, 4)), r(5, (5, 3)))
}

#[test]
fn parameter_gradients_are_the_vector_jacobian_product() -> Result<()> {
    let (params, w, b, _, x, g) = setup();
    // f(x) = x W + b  =>  dW = x^T g, db = column sums of g.
    let grads = replay(&params, &g, || {
        Ok(x.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())?)
    })?;
    assert!(close(grads.get("w").unwrap(), &x.t()?.matmul(&g)?));
    assert!(close(grads.get("b").unwrap(), &g.sum_keepdim(0)?));
    assert!(
        grads.get("unused").is_none(),
        "an unused parameter gets no gradient entry"
    );
    assert!(
        !grads.get("w").unwrap().track_op(),
        "gradients come back detached"
    );
    Ok(())
}

#[test]
fn input_gradient_is_returned_when_asked() -> Result<()> {
    let (params, w, b, _, x, g) = setup();
    let out = replay_with_input(&params, &x, &g, |x| {
        Ok(x.matmul(w.as_tensor())?
            .broadcast_add(b.as_tensor())?
            .tanh()?)
    })?;
    // y = tanh(xW + b)  =>  dx = (g * (1 - y^2)) W^T, dW = x^T (g * (1 - y^2)).
    let y = x
        .matmul(w.as_tensor())?
        .broadcast_add(b.as_tensor())?
        .tanh()?;
    let local = g.mul(&(1.0 - y.sqr()?)?)?;
    assert!(close(&out.input, &local.matmul(&w.as_tensor().t()?)?));
    assert!(close(out.params.get("w").unwrap(), &x.t()?.matmul(&local)?));
    assert!(!out.input.track_op());
    Ok(())
}

#[test]
fn input_gradient_is_zero_when_the_output_ignores_the_input() -> Result<()> {
    let (params, w, _, _, x, _) = setup();
    let g = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
    let out = replay_with_input(&params, &x, &g, |_| Ok(w.as_tensor().clone()))?;
    assert_eq!(out.input.dims(), x.dims());
    assert_eq!(out.input.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    assert!(close(out.params.get("w").unwrap(), &g));
    Ok(())
}
