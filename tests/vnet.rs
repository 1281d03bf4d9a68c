//! The VNet volume tower and its 3-D convolution: the convolution node equals a
//! composed reference (candle's 2-D convolutions summed over the kernel's depth, with
//! candle's autograd) forward and backward at several strides, paddings and piece sizes;
//! bad shapes are refused by name.

mod common;

use candle_core::{Tensor, Var};
use common::{max_abs, max_diff, random};

/// The 3-D convolution composed from candle's 2-D ones: output depth `z` is the sum over
/// the kernel's depth `kz` of the input's (padded) depth `z * stride + kz` convolved with
/// the kernel's slice `kz`.
fn conv3d_reference(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Tensor {
    let k = w.dim(2).unwrap();
    let xp = x.pad_with_zeros(2, padding, padding).unwrap();
    let out_d = (xp.dim(2).unwrap() - k) / stride + 1;
    let planes: Vec<Tensor> = (0..out_d)
        .map(|z| {
            let mut sum: Option<Tensor> = None;
            for kz in 0..k {
                let slice = xp
                    .narrow(2, z * stride + kz, 1)
                    .unwrap()
                    .squeeze(2)
                    .unwrap();
                let kernel = w.narrow(2, kz, 1).unwrap().squeeze(2).unwrap();
                let y = slice.conv2d(&kernel, padding, stride, 1, 1).unwrap();
                sum = Some(match sum {
                    Some(s) => (s + y).unwrap(),
                    None => y,
                });
            }
            sum.unwrap()
        })
        .collect();
    Tensor::stack(&planes, 2).unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    max_diff(a, b) / max_abs(b).max(1e-12)
}

#[test]
fn the_3d_convolution_equals_the_composed_reference_forward_and_backward() {
    // (rows, c_in, c_out, side, kernel, padding, stride)
    for &(n, ci, co, side, k, p, s) in &[
        (2, 3, 4, 6, 3, 1, 1),
        (2, 2, 5, 7, 5, 2, 1),
        (3, 4, 6, 8, 2, 0, 2),
        (1, 2, 3, 5, 3, 0, 2),
        (2, 1, 4, 4, 1, 0, 1),
    ] {
        // An uneven height at stride 1 (candle's own 2-D backward fails on strides that
        // leave a remainder, so the reference keeps those even).
        let h = side + usize::from(s == 1);
        let x = Var::from_tensor(&random(1, &[n, ci, side, h, side])).unwrap();
        let w = Var::from_tensor(&(random(2, &[co, ci, k, k, k]) * 0.3).unwrap()).unwrap();
        let dy = random(
            3,
            &[
                n,
                co,
                (side + 2 * p - k) / s + 1,
                (h + 2 * p - k) / s + 1,
                (side + 2 * p - k) / s + 1,
            ],
        );
        let got = gradcache::nn::conv3d(x.as_tensor(), w.as_tensor(), p, s).unwrap();
        let want = conv3d_reference(x.as_tensor(), w.as_tensor(), p, s);
        assert_eq!(got.dims(), want.dims());
        assert!(
            rel(&got, &want) < 1e-5,
            "forward {:?}: {}",
            (n, ci, co, side, k, p, s),
            rel(&got, &want)
        );
        let g_got = (got * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let g_want = (want * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("input", &x), ("kernel", &w)] {
            let (a, b) = (
                g_got.get(v.as_tensor()).unwrap(),
                g_want.get(v.as_tensor()).unwrap(),
            );
            assert!(
                rel(a, b) < 1e-5,
                "{name} gradient {:?}: {}",
                (n, ci, co, side, k, p, s),
                rel(a, b)
            );
        }
    }
}

#[test]
fn the_3d_convolution_over_many_pieces_equals_one_piece() {
    // 64 channels x 5^3 taps x 16^2 positions x 4 bytes = 8 MiB a plane: four planes a
    // piece, so a 16-deep volume runs in 4 pieces a row.
    let x = Var::from_tensor(&random(4, &[2, 64, 16, 16, 16])).unwrap();
    let w = Var::from_tensor(&(random(5, &[3, 64, 5, 5, 5]) * 0.05).unwrap()).unwrap();
    let dy = random(6, &[2, 3, 16, 16, 16]);
    let got = gradcache::nn::conv3d(x.as_tensor(), w.as_tensor(), 2, 1).unwrap();
    let want = conv3d_reference(x.as_tensor(), w.as_tensor(), 2, 1);
    assert!(rel(&got, &want) < 1e-5, "{}", rel(&got, &want));
    let g_got = (got * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let g_want = (want * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    for v in [&x, &w] {
        let (a, b) = (
            g_got.get(v.as_tensor()).unwrap(),
            g_want.get(v.as_tensor()).unwrap(),
        );
        assert!(rel(a, b) < 1e-5, "{}", rel(a, b));
    }
}

#[test]
fn bad_3d_convolution_shapes_are_refused_by_name() {
    let w = random(1, &[4, 3, 3, 3, 3]);
    for x in [
        random(2, &[2, 3, 8, 8]),
        random(2, &[2, 2, 8, 8, 8]),
        random(2, &[2, 3, 1, 8, 8]),
    ] {
        let err = gradcache::nn::conv3d(&x, &w, 0, 1).unwrap_err().to_string();
        assert!(err.contains("conv3d"), "{err}");
    }
    let x = random(2, &[2, 3, 8, 8, 8])
        .to_dtype(candle_core::DType::F64)
        .unwrap();
    let err = gradcache::nn::conv3d(&x, &w, 1, 1).unwrap_err().to_string();
    assert!(err.contains("f32"), "{err}");
}
