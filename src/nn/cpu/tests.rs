//! Tests across the CPU kernels: every vector copy of the row kernels gives the baseline
//! copy's bits, and the recomputing attention node gives the kept one's gradients.

use super::*;
use std::sync::atomic::Ordering;

use candle_core::Tensor;

use crate::nn::cpu::attention::softmax::{softmax_bwd, softmax_fwd};
use crate::nn::cpu::blocks::WIDEST;
use crate::nn::cpu::elementwise::accumulate::{add_elementwise, add_rows};
use crate::nn::cpu::elementwise::activation::{bias_act_bwd, bias_act_fwd};
use crate::nn::cpu::elementwise::dropout::dropout_add_fwd;
use crate::nn::cpu::elementwise::norm::{ln_bwd, ln_fwd};
use crate::nn::cpu::elementwise::rows;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        })
        .collect()
}

/// Every kernel's outputs, as bits.
fn run_all(width: usize) -> Vec<Vec<u32>> {
    let rows = 3 * BLOCK_ROWS + 5; // several blocks and a short last one
    let (x, dy) = (values(rows * width, 1), values(rows * width, 2));
    let (g, b) = (values(width, 3), values(width, 4));
    let mut outs = vec![
        ln_fwd(&x, &g, &b, 1e-12),
        ln_bwd(&x, &g, &dy, 1e-12),
        softmax_fwd(&x, &b, width, rows, 0.125),
        softmax_bwd(&softmax_fwd(&x, &b, width, rows, 0.125), &dy, width, 0.125),
        dropout_add_fwd(&x, Some(&dy), 11, 0.1, 0),
    ];
    for act in [Act::GeluErf, Act::GeluTanh, Act::Relu, Act::Silu] {
        outs.push(bias_act_fwd(&x, &b, act));
        outs.push(bias_act_bwd(&x, &b, &dy, act));
        let mut u = x.clone();
        outs.push(rows::activate(&mut u, Some(&b), act, width));
        outs.push(u);
        let mut u = x.clone();
        outs.push(rows::activate(&mut u, None, act, width));
        for bias in [None, Some(&b[..])] {
            let mut u = x.clone();
            rows::activate_in_place(&mut u, bias, act, width);
            outs.push(u);
        }
        let (value, slope) = rows::activate_with_slope(&x, act, width);
        outs.extend([value, slope]);
    }
    let places: Vec<usize> = (0..rows).collect();
    for (bias, dropout) in [
        (None, Some((5, 0.1))),
        (Some(&g[..]), Some((5, 0.1))),
        (Some(&g[..]), None),
    ] {
        let (sum, y) = rows::add_norm((&x, bias), &dy, dropout, (&g, &b), 1e-12, &places);
        let alone = rows::add_norm_output((&x, bias), &dy, dropout, (&g, &b), 1e-12, &places);
        assert!(
            alone
                .iter()
                .zip(&y)
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "add_norm_output differs from add_norm's normalised rows"
        );
        outs.extend([sum, y, alone]);
    }
    outs.push(rows::norm(&x, (&g, &b), 1e-12));
    outs.push(rows::rms(&x, &g, 1e-6, 1.0));
    let mut acc = x.clone();
    add_rows(&mut acc, &b);
    add_elementwise(&mut acc, &dy);
    outs.push(acc);
    outs.into_iter()
        .map(|v| v.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Every copy of the kernels (baseline, AVX2, AVX-512: those this CPU runs) gives the
/// same bits.
#[test]
fn wide_vector_kernels_give_the_baseline_bits() {
    let _widest = crate::nn::cpu::blocks::widest_held();
    #[cfg(target_arch = "x86_64")]
    eprintln!(
        "the widest copy this CPU runs: {:?}",
        crate::nn::cpu::blocks::vectors()
    );
    for width in [384, 37] {
        WIDEST.store(0, Ordering::Relaxed);
        let baseline = run_all(width);
        for widest in [1, 2] {
            WIDEST.store(widest, Ordering::Relaxed);
            let wide = run_all(width);
            for (i, (a, b)) in wide.iter().zip(&baseline).enumerate() {
                assert!(
                    a == b,
                    "kernel output {i} (width {width}) differs between the baseline \
                     copy and the copy of tier {widest}"
                );
            }
        }
        WIDEST.store(2, Ordering::Relaxed);
    }
}

fn tensor(dims: &[usize], seed: u64) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(values(n, seed), dims, &candle_core::Device::Cpu).expect("tensor")
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t.flatten_all().and_then(|t| t.to_vec1()).expect("values");
    v.iter().map(|f| f.to_bits()).collect()
}

/// The attention node that recomputes its probabilities in the backward gives the
/// bits of the one that keeps them (dropout on, a masked key inside one sequence,
/// trailing padding in another), and masked keys get no gradient.
#[test]
fn attention_recomputed_gives_the_kept_gradients_bit_for_bit() {
    let (n, heads, s, d) = (3, 2, 6, 4);
    let mut bias = vec![0f32; n * s];
    bias[2] = -10000.0; // inside sequence 0
    for v in &mut bias[s + 4..2 * s] {
        *v = -10000.0; // sequence 1: two padding keys
    }
    let grads = |recompute: bool| {
        let spec = AttentionSpec {
            bias: Tensor::from_vec(bias.clone(), (n, 1, 1, s), &candle_core::Device::Cpu)
                .expect("bias"),
            scale: 0.5,
            dropout: Some((9, 0.25)),
            recompute,
            window: None,
        };
        let vars: Vec<candle_core::Var> = (1..=3)
            .map(|seed| candle_core::Var::from_tensor(&tensor(&[n, heads, s, d], seed)))
            .collect::<candle_core::Result<_>>()
            .expect("vars");
        let out = attention(&vars[0], &vars[1], &vars[2], &spec).expect("attention");
        let store = (out * tensor(&[n, heads, s, d], 4))
            .and_then(|t| t.sum_all())
            .and_then(|t| t.backward())
            .expect("backward");
        vars.iter()
            .map(|v| store.get(v).expect("a gradient").clone())
            .collect::<Vec<_>>()
    };
    let (kept, recomputed) = (grads(false), grads(true));
    for (a, b) in kept.iter().zip(&recomputed) {
        assert_eq!(bits(a), bits(b));
    }
    // Keys 4 and 5 of sequence 1 and key 2 of sequence 0: zero key and value gradients.
    for g in &kept[1..] {
        let v: Vec<f32> = g.flatten_all().and_then(|t| t.to_vec1()).expect("values");
        for h in 0..heads {
            for (b, key) in [(1, 4), (1, 5), (0, 2)] {
                let at = ((b * heads + h) * s + key) * d;
                assert!(v[at..at + d].iter().all(|&x| x == 0.0), "key {key} of {b}");
            }
        }
    }
}
