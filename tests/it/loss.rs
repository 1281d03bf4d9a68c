//! InfoNCE against an independent f64 implementation on the host (value and gradients, with
//! hard negatives, symmetric on and off), and the row-block form against the one-block form.

use candle_core::{DType, Device, Tensor};
use gradcache::{InfoNce, Loss, Similarity};

use crate::common;

type Mat = Vec<Vec<f64>>;

fn mat(t: &Tensor) -> Mat {
    t.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap()
}

fn random(seed: u64, rows: usize, cols: usize) -> Tensor {
    common::random(seed, &[rows, cols])
}

/// Mean cross-entropy of `anchors` against `candidates` with targets `i * stride`, and its
/// gradients, written out by hand: dL/da_i = sum_j (s_ij - t_ij) c_j / (n tau), etc.
fn ce(anchors: &Mat, candidates: &Mat, stride: usize, tau: f64) -> (f64, Mat, Mat) {
    let n = anchors.len() as f64;
    let d = anchors[0].len();
    let mut loss = 0.0;
    let mut ga = vec![vec![0.0; d]; anchors.len()];
    let mut gc = vec![vec![0.0; d]; candidates.len()];
    for (i, a) in anchors.iter().enumerate() {
        let logits: Vec<f64> = candidates
            .iter()
            .map(|c| a.iter().zip(c).map(|(x, y)| x * y).sum::<f64>() / tau)
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        loss -= logits[i * stride] - max - z.ln();
        for (j, c) in candidates.iter().enumerate() {
            let coef = ((logits[j] - max).exp() / z - f64::from(j == i * stride)) / (n * tau);
            for k in 0..d {
                ga[i][k] += coef * c[k];
                gc[j][k] += coef * a[k];
            }
        }
    }
    (loss / n, ga, gc)
}

/// InfoNCE with dot similarity, by hand.
fn reference(q: &Mat, p: &Mat, tau: f64, symmetric: bool) -> (f64, Mat, Mat) {
    let group = p.len() / q.len();
    let (l1, mut gq, mut gp) = ce(q, p, group, tau);
    if !symmetric {
        return (l1, gq, gp);
    }
    let positives: Mat = (0..q.len()).map(|i| p[i * group].clone()).collect();
    let (l2, gpos, gq2) = ce(&positives, q, 1, tau);
    for (i, row) in gq.iter_mut().enumerate() {
        for (k, v) in row.iter_mut().enumerate() {
            *v = 0.5 * (*v + gq2[i][k]);
        }
    }
    for row in gp.iter_mut() {
        for v in row.iter_mut() {
            *v *= 0.5;
        }
    }
    for (i, row) in gpos.iter().enumerate() {
        for (k, v) in row.iter().enumerate() {
            gp[i * group][k] += 0.5 * v;
        }
    }
    (0.5 * (l1 + l2), gq, gp)
}

fn max_rel(a: &Mat, b: &Mat) -> f64 {
    let scale = b.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

#[test]
fn matches_a_hand_written_infonce() {
    let tau = 0.2;
    for hard in [0, 1, 3] {
        for symmetric in [false, true] {
            for block in [None, Some(1), Some(2), Some(64)] {
                let (q, p) = (random(1, 5, 4), random(2, 5 * (hard + 1), 4));
                let loss = InfoNce::new(tau)
                    .unwrap()
                    .with_symmetric(symmetric)
                    .with_block_rows(block)
                    .unwrap();
                let (want, want_gq, want_gp) = reference(&mat(&q), &mat(&p), tau, symmetric);
                let got = loss.value_and_grads(&q, &p).unwrap();
                let what = format!("hard={hard} symmetric={symmetric} block={block:?}");
                assert!(
                    (f64::from(got.loss) - want).abs() / want < 1e-6,
                    "{what}: loss {} vs {want}",
                    got.loss
                );
                assert!(
                    max_rel(&mat(&got.grad_queries), &want_gq) < 1e-5,
                    "{what}: dL/dq"
                );
                assert!(
                    max_rel(&mat(&got.grad_passages), &want_gp) < 1e-5,
                    "{what}: dL/dp"
                );
                let forward = loss.forward(&q, &p).unwrap().to_scalar::<f32>().unwrap();
                assert!(
                    (f64::from(forward) - want).abs() / want < 1e-6,
                    "{what}: forward {forward}"
                );
            }
        }
    }
}

#[test]
fn cosine_equals_dot_on_normalised_inputs() {
    let (q, p) = (random(3, 6, 5), random(4, 12, 5));
    let unit = |t: &Tensor| {
        t.broadcast_div(&t.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap())
            .unwrap()
    };
    let cos = InfoNce::new(0.05)
        .unwrap()
        .with_similarity(Similarity::Cosine)
        .with_block_rows(Some(4))
        .unwrap();
    let got = cos.value_and_grads(&q, &p).unwrap().loss;
    let (want, _, _) = reference(&mat(&unit(&q)), &mat(&unit(&p)), 0.05, false);
    assert!(
        (f64::from(got) - want).abs() / want < 1e-6,
        "{got} vs {want}"
    );
}

#[test]
fn correct_targets_give_a_lower_loss() {
    // Queries identical to their positives (and far from the rest) give a near-zero loss.
    let q = Tensor::new(&[[10f32, 0.0], [0.0, 10.0]], &Device::Cpu).unwrap();
    let good = InfoNce::new(1.0)
        .unwrap()
        .forward(&q, &q)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let swapped = Tensor::new(&[[0f32, 10.0], [10.0, 0.0]], &Device::Cpu).unwrap();
    let bad = InfoNce::new(1.0)
        .unwrap()
        .forward(&q, &swapped)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(good < 1e-6 && bad > 99.0, "good {good}, bad {bad}");
}
