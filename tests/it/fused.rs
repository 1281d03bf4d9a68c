//! Every fused kernel against the composed candle ops it replaces, forward and backward
//! (f32, at most 1e-6 of the largest entry, with padding masks and dropout on), and its
//! hand-written backward against central finite differences in f64.

use candle_core::{DType, Device, Tensor, Var};
use gradcache::nn::{
    bias_activation, bias_activation_composed, dropout, dropout_composed, layer_norm,
    layer_norm_composed, masked_softmax, masked_softmax_composed, mean_pool, mean_pool_composed,
    Act,
};

use crate::common;
use crate::common::{max_abs, max_diff, random};

const TOL: f64 = 1e-6;

/// `f(inputs)` and the gradients of `sum(f(inputs) * cotangent)` with respect to every
/// input.
fn value_and_grads(
    inputs: &[Tensor],
    cotangent: &Tensor,
    f: &dyn Fn(&[Tensor]) -> gradcache::Result<Tensor>,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let tracked: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tracked).unwrap();
    let store = (&y * cotangent.to_dtype(y.dtype()).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grads = vars
        .iter()
        .map(|v| store.get(v.as_tensor()).expect("a gradient").detach())
        .collect();
    (y.detach(), grads)
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    max_diff(a, b) / max_abs(b).max(1e-30)
}

/// Fused and composed agree forward and for the gradient of every input in `check`.
fn agree(
    name: &str,
    inputs: &[Tensor],
    check: &[usize],
    fused: &dyn Fn(&[Tensor]) -> gradcache::Result<Tensor>,
    composed: &dyn Fn(&[Tensor]) -> gradcache::Result<Tensor>,
) {
    let cot = random(99, fused(inputs).unwrap().dims());
    let (yf, gf) = value_and_grads(inputs, &cot, fused);
    let (yc, gc) = value_and_grads(inputs, &cot, composed);
    let e = rel(&yf, &yc);
    assert!(e <= TOL, "{name}: forward differs by {e:e}");
    for &i in check {
        let e = rel(&gf[i], &gc[i]);
        assert!(e <= TOL, "{name}: gradient of input {i} differs by {e:e}");
    }
}

/// The fused backward in f64 against central differences of `sum(f(x) * c)`, entry by
/// entry, for every input in `check`.
fn finite_differences(
    name: &str,
    inputs: &[Tensor],
    check: &[usize],
    f: &dyn Fn(&[Tensor]) -> gradcache::Result<Tensor>,
) {
    let inputs: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F64).unwrap())
        .collect();
    let cot = random(7, f(&inputs).unwrap().dims())
        .to_dtype(DType::F64)
        .unwrap();
    let (_, grads) = value_and_grads(&inputs, &cot, f);
    let objective = |xs: &[Tensor]| -> f64 {
        (f(xs).unwrap() * &cot)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let h = 1e-6;
    for &i in check {
        let flat = inputs[i].flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let analytic = grads[i].flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let scale = analytic.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for j in 0..flat.len() {
            let at = |delta: f64| {
                let mut v = flat.clone();
                v[j] += delta;
                let mut xs = inputs.clone();
                xs[i] = Tensor::from_vec(v, inputs[i].shape(), &Device::Cpu).unwrap();
                objective(&xs)
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            let err = (numeric - analytic[j]).abs() / scale;
            assert!(
                err <= 1e-6,
                "{name}: input {i} entry {j}: analytic {} vs numeric {numeric} ({err:e})",
                analytic[j]
            );
        }
    }
}

#[test]
fn layer_norm_matches_its_composed_form_and_finite_differences() {
    let x = random(1, &[6, 10, 16]);
    // Non-trivial scale and shift, so their gradients are not the trivial ones.
    let gamma = random(2, &[16]).affine(0.5, 1.0).unwrap();
    let beta = random(3, &[16]);
    let inputs = [x, gamma, beta];
    agree(
        "layer norm",
        &inputs,
        &[0, 1, 2],
        &|t| layer_norm(&t[0], &t[1], &t[2], 1e-12),
        &|t| layer_norm_composed(&t[0], &t[1], &t[2], 1e-12),
    );
    let small = [
        random(4, &[3, 5]),
        (random(5, &[5]) + 1.0).unwrap(),
        random(6, &[5]),
    ];
    finite_differences("layer norm", &small, &[0, 1, 2], &|t| {
        layer_norm(&t[0], &t[1], &t[2], 1e-5)
    });
}

/// An additive key mask `[n, 1, 1, k]`: sequence `i` has `k - i` real keys, the rest are
/// padding at -10000 (BERT's bias).
fn padding_bias(n: usize, k: usize) -> Tensor {
    let v: Vec<f32> = (0..n)
        .flat_map(|i| (0..k).map(move |j| if j + i < k { 0.0 } else { -10000.0 }))
        .collect();
    Tensor::from_vec(v, (n, 1, 1, k), &Device::Cpu).unwrap()
}

#[test]
fn masked_softmax_matches_its_composed_form_and_finite_differences() {
    let scores = random(10, &[3, 2, 5, 7]);
    let bias = padding_bias(3, 7);
    let f = |t: &[Tensor]| masked_softmax(&t[0], &bias, 0.35);
    let c = |t: &[Tensor]| masked_softmax_composed(&t[0], &bias, 0.35);
    agree("masked softmax", &[scores], &[0], &f, &c);
    let bias64 = padding_bias(2, 4).to_dtype(DType::F64).unwrap();
    finite_differences("masked softmax", &[random(11, &[2, 2, 3, 4])], &[0], &|t| {
        masked_softmax(&t[0], &bias64, 0.7)
    });
}

/// A 0/1 mask `[n, s]`: row `i` has `s - 2 i` real tokens (none from `i = s / 2` on).
fn token_mask(n: usize, s: usize) -> Tensor {
    let v: Vec<f32> = (0..n)
        .flat_map(|i| (0..s).map(move |j| if j + 2 * i < s { 1.0 } else { 0.0 }))
        .collect();
    Tensor::from_vec(v, (n, s), &Device::Cpu).unwrap()
}

#[test]
fn mean_pooling_matches_its_composed_form_and_finite_differences() {
    // The last row has no real token (its mean counts one position, as the composed form).
    let x = random(20, &[4, 6, 8]);
    let mask = token_mask(4, 6);
    for normalize in [false, true] {
        agree(
            &format!("mean pooling, normalize {normalize}"),
            std::slice::from_ref(&x),
            &[0],
            &|t| mean_pool(&t[0], &mask, normalize),
            &|t| mean_pool_composed(&t[0], &mask, normalize),
        );
        let mask64 = token_mask(3, 4).to_dtype(DType::F64).unwrap();
        finite_differences(
            &format!("mean pooling, normalize {normalize}"),
            &[random(21, &[3, 4, 5])],
            &[0],
            &|t| mean_pool(&t[0], &mask64, normalize),
        );
    }
    // Padding positions get no gradient and take no part in the result.
    let cot = random(22, &[4, 8]);
    let (y, g) = value_and_grads(std::slice::from_ref(&x), &cot, &|t| {
        mean_pool(&t[0], &mask, true)
    });
    let g = g[0].to_vec3::<f32>().unwrap();
    let m = mask.to_vec2::<f32>().unwrap();
    for (i, row) in m.iter().enumerate() {
        for (j, &keep) in row.iter().enumerate() {
            if keep == 0.0 {
                assert!(
                    g[i][j].iter().all(|&v| v == 0.0),
                    "padding ({i}, {j}) got a gradient"
                );
            }
        }
    }
    let noise = (x.clone() + (random(23, &[4, 6, 8]) * 100.0).unwrap()).unwrap();
    let padded_noise = noise
        .broadcast_mul(&(1.0 - &mask).unwrap().unsqueeze(2).unwrap())
        .unwrap();
    let moved = mean_pool(&(&x + padded_noise).unwrap(), &mask, true).unwrap();
    assert_eq!(
        moved.to_vec2::<f32>().unwrap(),
        y.to_vec2::<f32>().unwrap(),
        "padding moved the pooled output"
    );
}

#[test]
fn dropout_has_the_composed_mask_bit_for_bit() {
    // 4 x 1,033 elements: several kernel blocks and a ragged last one.
    let x = random(20, &[4, 1033]);
    for (seed, p) in [(3u64, 0.1f32), (4, 0.5), (5, 0.0)] {
        let fused = dropout(&x, seed, p).unwrap();
        let composed = dropout_composed(&x, seed, p).unwrap();
        let (a, b) = (common::bits(&fused), common::bits(&composed));
        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        assert_eq!(differ, 0, "seed {seed}, p {p}: {differ} entries differ");
        agree(
            "dropout",
            std::slice::from_ref(&x),
            &[0],
            &|t| dropout(&t[0], seed, p),
            &|t| dropout_composed(&t[0], seed, p),
        );
    }
    let kept = dropout(&x.ones_like().unwrap(), 9, 0.25)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let dropped = kept.iter().filter(|&&v| v == 0.0).count() as f64 / kept.len() as f64;
    assert!((dropped - 0.25).abs() < 0.02, "drop rate {dropped}");
    assert!(kept.iter().all(|&v| v == 0.0 || v == 1.0 / 0.75));
}

#[test]
fn bias_activations_match_their_composed_forms_and_finite_differences() {
    for act in [Act::GeluErf, Act::GeluTanh, Act::Relu] {
        let x = random(30, &[5, 9, 12]);
        let b = random(31, &[12]);
        agree(
            &format!("{act:?}"),
            &[x, b],
            &[0, 1],
            &|t| bias_activation(&t[0], &t[1], act),
            &|t| bias_activation_composed(&t[0], &t[1], act),
        );
        // Away from ReLU's kink, where the derivative is undefined.
        let x = random(32, &[3, 4]);
        let x = (x.sign().unwrap() * 0.1 + &x).unwrap();
        finite_differences(
            &format!("{act:?}"),
            &[x, Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()],
            &[0, 1],
            &|t| bias_activation(&t[0], &t[1], act),
        );
    }
}

#[test]
fn linear_node_matches_the_composed_product_and_finite_differences() {
    use gradcache::nn::{linear, linear_composed};
    let inputs = [
        random(40, &[3, 7, 12]),
        random(41, &[5, 12]),
        random(42, &[5]),
    ];
    agree(
        "linear",
        &inputs,
        &[0, 1, 2],
        &|t| linear(&t[0], &t[1], Some(&t[2])),
        &|t| linear_composed(&t[0], &t[1], Some(&t[2])),
    );
    let small = [
        random(43, &[2, 3, 4]),
        random(44, &[3, 4]),
        random(45, &[3]),
    ];
    finite_differences("linear", &small, &[0, 1, 2], &|t| {
        linear(&t[0], &t[1], Some(&t[2]))
    });
}

#[test]
fn attention_node_matches_the_composed_attention_and_finite_differences() {
    use gradcache::nn::{attention, attention_composed, AttentionSpec};
    let (n, heads, s, d) = (3, 2, 7, 4);
    let inputs = [
        random(50, &[n, heads, s, d]),
        random(51, &[n, heads, s, d]),
        random(52, &[n, heads, s, d]),
    ];
    let drop = Some((11u64, 0.3f32));
    for (dropout, recompute) in [(None, false), (None, true), (drop, false), (drop, true)] {
        let spec = AttentionSpec {
            bias: padding_bias(n, s),
            scale: 0.5,
            dropout,
            recompute,
            window: None,
        };
        agree(
            &format!("attention, dropout {dropout:?}, recompute {recompute}"),
            &inputs,
            &[0, 1, 2],
            &|t| attention(&t[0], &t[1], &t[2], &spec),
            &|t| attention_composed(&t[0], &t[1], &t[2], &spec),
        );
        let spec64 = AttentionSpec {
            bias: padding_bias(2, 3).to_dtype(DType::F64).unwrap(),
            ..spec.clone()
        };
        let small = [
            random(53, &[2, 2, 3, 2]),
            random(54, &[2, 2, 3, 2]),
            random(55, &[2, 2, 3, 2]),
        ];
        finite_differences("attention", &small, &[0, 1, 2], &|t| {
            attention(&t[0], &t[1], &t[2], &spec64)
        });
    }
}

#[test]
fn windowed_attention_matches_an_explicit_window_mask_and_finite_differences() {
    use gradcache::nn::{attention, attention_composed, AttentionSpec};
    let (n, heads, s, d) = (3, 2, 9, 4);
    let inputs = [
        random(56, &[n, heads, s, d]),
        random(57, &[n, heads, s, d]),
        random(58, &[n, heads, s, d]),
    ];
    // The key mask with the window folded in, written out here: query i sees keys j with
    // |i - j| <= w (ModernBERT's local layers).
    let explicit = |w: usize| -> Tensor {
        let mut v = Vec::new();
        for b in 0..n {
            for i in 0..s {
                for j in 0..s {
                    let padding = j + b >= s;
                    let outside = i.abs_diff(j) > w;
                    v.push(if padding || outside { -10000f32 } else { 0.0 });
                }
            }
        }
        Tensor::from_vec(v, (n, 1, s, s), &Device::Cpu).unwrap()
    };
    // Padding queries (rows past a sequence's last real key) are left out of the
    // comparison: their outputs reach nothing in a model, and a padding row whose window
    // holds no real key attends unwindowed in the kernel but uniformly under a full mask.
    let real_queries = padding_bias(n, s)
        .affine(1e-4, 1.0)
        .unwrap()
        .reshape((n, 1, s, 1))
        .unwrap();
    let drop = Some((13u64, 0.2f32));
    for w in [1, 3] {
        for (dropout, recompute) in [(None, false), (drop, false), (drop, true)] {
            let spec = AttentionSpec {
                bias: padding_bias(n, s),
                scale: 0.5,
                dropout,
                recompute,
                window: Some(w),
            };
            let full = AttentionSpec {
                bias: explicit(w),
                window: None,
                ..spec.clone()
            };
            agree(
                &format!("windowed attention, w {w}, dropout {dropout:?}, recompute {recompute}"),
                &inputs,
                &[0, 1, 2],
                &|t| Ok(attention(&t[0], &t[1], &t[2], &spec)?.broadcast_mul(&real_queries)?),
                &|t| {
                    Ok(attention_composed(&t[0], &t[1], &t[2], &full)?
                        .broadcast_mul(&real_queries)?)
                },
            );
            // The composed form honours the window the same way.
            agree(
                &format!("composed window, w {w}"),
                &inputs,
                &[0, 1, 2],
                &|t| {
                    Ok(attention_composed(&t[0], &t[1], &t[2], &spec)?
                        .broadcast_mul(&real_queries)?)
                },
                &|t| {
                    Ok(attention_composed(&t[0], &t[1], &t[2], &full)?
                        .broadcast_mul(&real_queries)?)
                },
            );
        }
    }
    let spec64 = AttentionSpec {
        bias: padding_bias(2, 5).to_dtype(DType::F64).unwrap(),
        scale: 0.5,
        dropout: None,
        recompute: false,
        window: Some(1),
    };
    let small = [
        random(59, &[2, 2, 5, 2]),
        random(60, &[2, 2, 5, 2]),
        random(61, &[2, 2, 5, 2]),
    ];
    finite_differences("windowed attention", &small, &[0, 1, 2], &|t| {
        attention(&t[0], &t[1], &t[2], &spec64)
    });
}

#[test]
fn glu_and_rotary_nodes_match_their_composed_forms_and_finite_differences() {
    use gradcache::nn::{glu, glu_composed, rotary, rotary_composed, Act};
    for act in [Act::GeluErf, Act::GeluTanh, Act::Relu] {
        let x = random(80, &[3, 5, 2 * 6]);
        agree(
            &format!("glu {act:?}"),
            &[x],
            &[0],
            &|t| glu(&t[0], act),
            &|t| glu_composed(&t[0], act),
        );
        finite_differences("glu", &[random(81, &[2, 3, 2 * 4])], &[0], &|t| {
            glu(&t[0], act)
        });
    }
    // Tables whose halves differ (ModernBERT's repeat their frequencies; the node must
    // not rely on it).
    let (s, d) = (5, 6);
    let cos = random(82, &[s, d]);
    let sin = random(83, &[s, d]);
    agree(
        "rotary",
        &[random(84, &[2, 3, s, d])],
        &[0],
        &|t| rotary(&t[0], &cos, &sin),
        &|t| rotary_composed(&t[0], &cos, &sin),
    );
    let (cos64, sin64) = (
        cos.to_dtype(DType::F64).unwrap(),
        sin.to_dtype(DType::F64).unwrap(),
    );
    finite_differences("rotary", &[random(85, &[2, 2, s, d])], &[0], &|t| {
        rotary(&t[0], &cos64, &sin64)
    });
}

#[test]
fn add_norm_node_matches_dropout_addition_and_layer_norm_composed_and_finite_differences() {
    use gradcache::nn::cpu;
    let h = 6;
    let composed = |t: &[Tensor], dropout: Option<(u64, f32)>| -> gradcache::Result<Tensor> {
        let x = match dropout {
            Some((seed, p)) => dropout_composed(&t[0], seed, p)?,
            None => t[0].clone(),
        };
        let (gamma, beta) = (t[2].get(0)?, t[2].get(1)?);
        layer_norm_composed(&(x + &t[1])?, &gamma, &beta, 1e-5)
    };
    let inputs = [
        random(70, &[3, 5, h]),
        random(71, &[3, 5, h]),
        random(72, &[2, h]),
    ];
    for dropout in [None, Some((17u64, 0.25f32))] {
        agree(
            &format!("add-norm, dropout {dropout:?}"),
            &inputs,
            &[0, 1, 2],
            &|t| Ok(cpu::add_norm(&t[0], &t[1], &t[2], 1e-5, dropout)?),
            &|t| composed(t, dropout),
        );
        let small = [
            random(73, &[2, 4]),
            random(74, &[2, 4]),
            random(75, &[2, 4]),
        ];
        finite_differences("add-norm", &small, &[0, 1, 2], &|t| {
            Ok(cpu::add_norm(&t[0], &t[1], &t[2], 1e-5, dropout)?)
        });
    }
    assert!(cpu::add_norm(&inputs[0], &inputs[1], &random(76, &[h]), 1e-5, None).is_err());
}

/// Self-attention from the hidden states as the nodes it replaces compute it (each checked
/// against its composed form above): three projections (the rows of the stacked weight),
/// heads split, attention, heads merged.
fn self_attention_unfused(
    t: &[Tensor],
    heads: usize,
    spec: &gradcache::nn::AttentionSpec,
) -> gradcache::Result<Tensor> {
    use gradcache::nn::{attention as attention_composed, linear as linear_composed};
    let (n, s, h) = t[0].dims3()?;
    let project = |i: usize| -> gradcache::Result<Tensor> {
        let w = t[1].narrow(0, i * h, h)?;
        let b = t[2].narrow(0, i * h, h)?;
        let y = linear_composed(&t[0], &w, Some(&b))?;
        Ok(y.reshape((n, s, heads, h / heads))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let ctx = attention_composed(&project(0)?, &project(1)?, &project(2)?, spec)?;
    Ok(ctx.transpose(1, 2)?.reshape((n, s, h))?)
}

#[test]
fn self_attention_node_matches_the_projection_and_attention_nodes_and_finite_differences() {
    use gradcache::nn::{cpu, AttentionSpec};
    let (n, s, h, heads) = (3, 7, 8, 2);
    let inputs = [
        random(60, &[n, s, h]),
        random(61, &[3 * h, h]),
        random(62, &[3 * h]),
    ];
    let drop = Some((13u64, 0.3f32));
    for (dropout, recompute) in [(None, false), (None, true), (drop, false), (drop, true)] {
        let spec = AttentionSpec {
            bias: padding_bias(n, s),
            scale: 0.5,
            dropout,
            recompute,
            window: None,
        };
        let fused_fn = |t: &[Tensor]| -> gradcache::Result<Tensor> {
            Ok(cpu::self_attention(&t[0], &t[1], &t[2], heads, &spec)?)
        };
        let name = format!("self-attention, dropout {dropout:?}, recompute {recompute}");
        agree(&name, &inputs, &[0], &fused_fn, &|t| {
            self_attention_unfused(t, heads, &spec)
        });
        // The stacked [3h, h] product sums in another order than three [h, h] products
        // (measured 1.2e-6 on the query blocks, whose gradients are small next to the
        // terms they sum): the parameter gradients are held to 2e-6, and exactly to the
        // mathematics by the finite differences below. The key bias shifts every score of
        // a row equally, which softmax ignores: its gradient is zero, and both sides hold
        // rounding noise there.
        let cot = random(99, &[n, s, h]);
        let (_, gf) = value_and_grads(&inputs, &cot, &fused_fn);
        let (_, gu) = value_and_grads(&inputs, &cot, &|t| self_attention_unfused(t, heads, &spec));
        let block = |g: &Tensor, i: usize| g.narrow(0, i * h, h).unwrap();
        for i in 0..3 {
            let e = rel(&block(&gf[1], i), &block(&gu[1], i));
            assert!(e <= 2e-6, "{name}: weight block {i} differs by {e:e}");
        }
        for i in [0, 2] {
            let e = rel(&block(&gf[2], i), &block(&gu[2], i));
            assert!(e <= 2e-6, "{name}: bias block {i} differs by {e:e}");
        }
        let noise = max_abs(&block(&gf[2], 1)) / max_abs(&gf[2]);
        assert!(
            noise <= 1e-5,
            "{name}: key bias gradient {noise:e}, not zero"
        );
        let spec64 = AttentionSpec {
            bias: padding_bias(2, 3).to_dtype(DType::F64).unwrap(),
            ..spec.clone()
        };
        let small = [
            random(63, &[2, 3, 4]),
            random(64, &[12, 4]),
            random(65, &[12]),
        ];
        finite_differences("self-attention", &small, &[0, 1, 2], &|t| {
            Ok(cpu::self_attention(&t[0], &t[1], &t[2], 2, &spec64)?)
        });
    }
    // A projection that does not stack three hidden-size blocks is an error, not a panic.
    let wrong = random(66, &[2 * h, h]);
    assert!(cpu::self_attention(
        &inputs[0],
        &wrong,
        &inputs[2],
        heads,
        &AttentionSpec {
            bias: padding_bias(n, s),
            scale: 0.5,
            dropout: None,
            recompute: false,
            window: None,
        }
    )
    .is_err());
}

#[test]
fn the_f32_exponential_is_within_two_ulp() {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x < 88.0 {
        let got = f64::from(gradcache::nn::cpu::exp(x));
        let want = f64::from(x).exp();
        worst = worst.max((got - want).abs() / want);
        x += 0.0137;
    }
    assert!(worst <= 2.5e-7, "max relative error {worst:e}");
}

#[test]
fn shapes_that_do_not_fit_are_errors_not_panics() {
    use gradcache::nn::cpu;
    let x = random(80, &[2, 3, 4]);
    // A bias or LayerNorm parameter of another width than the input's last dimension.
    assert!(bias_activation(&x, &random(81, &[5]), Act::GeluErf).is_err());
    assert!(layer_norm(&x, &random(82, &[5]), &random(83, &[4]), 1e-5).is_err());
    assert!(layer_norm(&x, &random(84, &[4]), &random(85, &[3]), 1e-5).is_err());
    // A token mask of another shape than the hidden states'.
    assert!(mean_pool(&x, &token_mask(2, 4), true).is_err());
    // A key mask for another number of keys.
    assert!(masked_softmax(&random(86, &[2, 2, 3, 3]), &padding_bias(2, 4), 1.0).is_err());
    // Selective-recompute nodes: a down projection that does not take the up
    // projection's width, a key bias of another width, token types of another shape.
    let (wu, bu) = (random(89, &[8, 4]), random(90, &[8]));
    assert!(
        cpu::feed_forward_recomputed(&x, &wu, &bu, &random(91, &[4, 6]), None, Act::Relu).is_err()
    );
    let spec = cpu::AttentionSpec {
        bias: padding_bias(2, 3),
        scale: 0.5,
        dropout: None,
        recompute: true,
        window: None,
    };
    let (w, b) = (random(92, &[4, 4]), random(93, &[4]));
    assert!(cpu::self_attention_projections(
        &x,
        [&w, &w, &w],
        [&b, &random(94, &[3]), &b],
        2,
        &spec
    )
    .is_err());
    let ids = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu).unwrap();
    let (words, types, positions) = (
        random(95, &[8, 4]),
        random(96, &[2, 4]),
        random(97, &[5, 4]),
    );
    let (gamma, beta) = (random(98, &[4]), random(99, &[4]));
    assert!(cpu::embeddings_recomputed(
        [&ids, &ids.narrow(1, 0, 2).unwrap()],
        [&words, &types, &positions],
        [&gamma, &beta],
        1e-12,
        None
    )
    .is_err());
    // Accumulating a gradient of another shape leaves the accumulator as it was.
    let acc = random(87, &[6]).copy().unwrap();
    let before = acc.to_vec1::<f32>().unwrap();
    assert!(cpu::add_in_place(&acc, &random(88, &[5])).is_err());
    assert_eq!(acc.to_vec1::<f32>().unwrap(), before);
}

/// The selective-recompute node keeps only its inputs and gives the gradients of the
/// function recorded directly, bit for bit: for one to five inputs (beyond three the
/// gradients travel through relay nodes), composed ops inside and fused ones.
#[test]
fn recomputed_nodes_give_the_gradients_of_the_recorded_function_bit_for_bit() {
    use gradcache::nn::{linear_composed, recomputed};
    type F = fn(&[Tensor]) -> gradcache::Result<Tensor>;
    let cases: [(&str, Vec<Vec<usize>>, F); 5] = [
        ("one input", vec![vec![5, 6]], |t| Ok(t[0].exp()?)),
        ("two inputs", vec![vec![5, 6]; 2], |t| {
            Ok((&t[0] * &t[1])?.tanh()?)
        }),
        (
            "four inputs: activation and linear, composed",
            vec![vec![5, 6], vec![6], vec![3, 6], vec![3]],
            |t| {
                let h = bias_activation_composed(&t[0], &t[1], Act::GeluErf)?;
                linear_composed(&h, &t[2], Some(&t[3]))
            },
        ),
        (
            "four inputs: fused layer norm of a sum",
            vec![vec![5, 6], vec![5, 6], vec![6], vec![6]],
            |t| layer_norm(&(&t[0] + &t[1])?, &t[2], &t[3], 1e-5),
        ),
        ("five inputs", vec![vec![4, 3]; 5], |t| {
            Ok(((((&t[0] * &t[1])? + &t[2])?.tanh()? * &t[3])? - &t[4])?)
        }),
    ];
    for (c, (name, shapes, f)) in cases.into_iter().enumerate() {
        let inputs: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| random(200 + 10 * c as u64 + i as u64, s))
            .collect();
        let cot = random(299, f(&inputs).unwrap().dims());
        let (y, g) = value_and_grads(&inputs, &cot, &f);
        let node = move |t: &[Tensor]| {
            let refs: Vec<&Tensor> = t.iter().collect();
            recomputed("test", &refs, f)
        };
        let (yr, gr) = value_and_grads(&inputs, &cot, &node);
        assert_eq!(max_diff(&y, &yr), 0.0, "{name}: forward");
        assert_eq!(g.len(), gr.len());
        for (i, (a, b)) in g.iter().zip(&gr).enumerate() {
            assert_eq!(max_diff(a, b), 0.0, "{name}: gradient of input {i}");
        }
    }
}

/// The feed-forward node that recomputes its activation gives the gradients of the three
/// nodes it stands for (`linear`, `bias_activation`, `linear`) bit for bit, with and
/// without the down projection's bias.
#[test]
fn recomputed_feed_forward_gives_the_gradients_of_its_three_nodes_bit_for_bit() {
    use gradcache::nn::{cpu, linear};
    let x = random(300, &[2, 5, 6]);
    let (wu, bu, wd, bd) = (
        random(301, &[12, 6]),
        random(302, &[12]),
        random(303, &[6, 12]),
        random(304, &[6]),
    );
    let cot = random(305, &[2, 5, 6]);
    for with_bias in [true, false] {
        let inputs: Vec<Tensor> = if with_bias {
            vec![x.clone(), wu.clone(), bu.clone(), wd.clone(), bd.clone()]
        } else {
            vec![x.clone(), wu.clone(), bu.clone(), wd.clone()]
        };
        let chain = |t: &[Tensor]| -> gradcache::Result<Tensor> {
            let h = bias_activation(&linear(&t[0], &t[1], None)?, &t[2], Act::GeluErf)?;
            linear(&h, &t[3], t.get(4))
        };
        let node = |t: &[Tensor]| -> gradcache::Result<Tensor> {
            Ok(cpu::feed_forward_recomputed(
                &t[0],
                &t[1],
                &t[2],
                &t[3],
                t.get(4),
                Act::GeluErf,
            )?)
        };
        let (y, g) = value_and_grads(&inputs, &cot, &chain);
        let (yr, gr) = value_and_grads(&inputs, &cot, &node);
        assert_eq!(
            common::bits(&y),
            common::bits(&yr),
            "bias {with_bias}: forward"
        );
        for (i, (a, b)) in g.iter().zip(&gr).enumerate() {
            assert_eq!(
                common::bits(a),
                common::bits(b),
                "bias {with_bias}: gradient of input {i}"
            );
        }
    }
}

/// The layer nodes refuse weights, tables and score biases that do not fit the input,
/// naming what does not fit.
#[test]
fn layer_nodes_refuse_what_does_not_fit() {
    use gradcache::nn::cpu::prenorm_layer::{prenorm_layer, PreNormSpec, PreNormWeights};
    use gradcache::nn::{Act, AttentionSpec};
    let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &Device::Cpu).unwrap();
    let (n, s, h, inter, heads) = (2, 5, 8, 12, 2);
    let x = z(&[n, s, h]);
    let attention = AttentionSpec {
        bias: z(&[n, 1, 1, s]),
        scale: 0.5,
        dropout: None,
        recompute: false,
        window: None,
    };
    let (g, wqkv, wo, wi, wd) = (
        z(&[h]),
        z(&[3 * h, h]),
        z(&[h, h]),
        z(&[2 * inter, h]),
        z(&[h, inter]),
    );
    let weights = PreNormWeights {
        attention_norm: None,
        qkv: (&wqkv, None),
        attention_output: (&wo, None),
        mlp_norm: (&g, None),
        up: (&wi, None),
        down: (&wd, None),
        lora: Default::default(),
    };
    let spec = PreNormSpec {
        heads,
        act: Act::GeluErf,
        eps: 1e-5,
        attention: attention.clone(),
        // Tables for 4 places, not 5.
        rotary: (z(&[s - 1, h / heads]), z(&[s - 1, h / heads])),
        attention_output_dropout: None,
        mlp_dropout: None,
    };
    let err = prenorm_layer(&x, &weights, &spec).unwrap_err().to_string();
    assert!(
        err.contains("pre-norm layer") && err.contains("rotary"),
        "{err}"
    );
    let spec = PreNormSpec {
        rotary: (z(&[s, h / heads]), z(&[s, h / heads])),
        ..spec
    };
    assert!(prenorm_layer(&x, &weights, &spec).is_ok());
    let short_down = z(&[h, inter - 1]);
    let bad = PreNormWeights {
        down: (&short_down, None),
        ..weights.clone()
    };
    let err = prenorm_layer(&x, &bad, &spec).unwrap_err().to_string();
    assert!(err.contains("do not fit"), "{err}");
    // An adapter whose A does not take the projection's input.
    let mut bad = weights.clone();
    bad.lora[0] = Some(gradcache::nn::lora::LoraInput {
        a: z(&[2, h + 1]),
        b: z(&[3 * h, 2]),
        scale: 1.0,
        dropout: None,
    });
    let err = prenorm_layer(&x, &bad, &spec).unwrap_err().to_string();
    assert!(err.contains("do not fit"), "{err}");

    // BERT's layer node with a score bias for 4 tokens on 5.
    use gradcache::nn::cpu::encoder_layer::{encoder_layer, LayerSpec, LayerWeights};
    let (wq, b, wi4, bi4, wd4) = (
        z(&[h, h]),
        z(&[h]),
        z(&[4 * h, h]),
        z(&[4 * h]),
        z(&[h, 4 * h]),
    );
    let w = LayerWeights {
        qkv: [&wq, &wq, &wq],
        qkv_bias: [&b, &b, &b],
        attention_output: (&wq, &b),
        attention_norm: (&g, &b),
        intermediate: (&wi4, &bi4),
        output: (&wd4, &b),
        output_norm: (&g, &b),
        lora: Default::default(),
    };
    let spec = LayerSpec {
        heads,
        act: Act::GeluErf,
        eps: 1e-12,
        attention,
        attention_output_dropout: None,
        output_dropout: None,
        recompute_attention_norm: false,
        recompute_intermediate: false,
        recompute_output_norm: false,
        score_bias: Some(z(&[1, heads, s - 1, s - 1])),
        relative: None,
    };
    let err = encoder_layer(&x, &w, &spec).unwrap_err().to_string();
    assert!(err.contains("score bias"), "{err}");
    let spec = LayerSpec {
        score_bias: Some(z(&[1, heads, s, s])),
        ..spec
    };
    assert!(encoder_layer(&x, &w, &spec).is_ok());
}
