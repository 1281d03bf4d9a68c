//! The GPU's own checks (`gradcache self-check --device cuda`, the bundle's `cuda-tests`
//! stage): every CUDA kernel of the GPU layer nodes against its CPU reference form on the
//! same inputs, in f32, bf16 and f16; the dropout masks of both devices element for
//! element; AdamW's and SGD's kernels against the CPU's update bit for bit; BERT's layer
//! node on the GPU against the same node on the CPU and against the op-by-op layer on the
//! GPU. On the CPU these compare the reference forms with themselves (the test suite runs
//! them so that they run at all); on a GPU they say which kernel is wrong, by name.

use candle_core::{DType, Device, Tensor, Var};

use super::{relative_error, CheckResult};
use crate::nn::cpu::encoder_layer::{LayerSpec, LayerWeights};
use crate::nn::kernels as k;
use crate::nn::{Act, AttentionSpec};
use crate::train::optim::{Optimizer, OptimizerKind};
use crate::{Params, Result};

/// `||got - want|| / ||want||` over the values of two tensors on any devices.
fn rel(got: &Tensor, want: &Tensor) -> Result<f64> {
    let f = |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?) };
    let (g, w) = (f(got)?, f(want)?);
    if g.dims() != w.dims() {
        return Ok(f64::INFINITY);
    }
    let norm = |t: &Tensor| -> Result<f64> { Ok(t.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt()) };
    let e = norm(&(g - &w)?)? / norm(&w)?.max(f64::MIN_POSITIVE);
    Ok(if e.is_nan() { f64::INFINITY } else { e })
}

/// The largest [`rel`] of pairs of outputs.
fn worst(pairs: &[(&Tensor, &Tensor)]) -> Result<f64> {
    pairs
        .iter()
        .try_fold(0f64, |m, (g, w)| Ok(m.max(rel(g, w)?)))
}

/// The limit of a kernel's relative error in `dtype`: its outputs are rounded to it.
fn limit(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        _ => 1e-5,
    }
}

fn name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        _ => "f32",
    }
}

/// Normal values of `shape`, the same on every device: drawn on the host (f32), rounded
/// to `dtype`, copied to `device`.
fn normal(seed: u64, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let t = crate::rng::normal(seed, 0.0, 1.0, &shape.into(), DType::F32, &Device::Cpu)?;
    Ok(t.to_dtype(dtype)?.to_device(device)?)
}

/// The same tensor on the CPU (the reference's input).
fn cpu(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&Device::Cpu)?)
}

/// The kernel checks on `device` (see the module's documentation). On the CPU, where
/// the kernels are their reference forms, only the layer node against the op-by-op layer.
pub fn run(device: &Device) -> Result<Vec<CheckResult>> {
    let mut out = Vec::new();
    if !device.is_cpu() {
        kernels(device, &mut out)?;
    }
    layer_node(device, &mut out)?;
    Ok(out)
}

/// Every kernel against its reference form, and the optimizer against the CPU's.
fn kernels(device: &Device, out: &mut Vec<CheckResult>) -> Result<()> {
    // Every module and kernel loads (the driver compiles the PTX for this GPU): a failure
    // is an error naming the kernel.
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        crate::nn::cuda::load_all(dev)?;
    }
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        rows(device, dtype, out)?;
        attention(device, dtype, out)?;
    }
    optimizer(device, out)
}

fn push(out: &mut Vec<CheckResult>, what: &str, dtype: DType, value: f64) {
    out.push(CheckResult {
        name: format!("kernel {what}, {}", name(dtype)),
        value,
        limit: limit(dtype),
    });
}

/// The norm, activation, dropout and column-sum kernels.
fn rows(device: &Device, dtype: DType, out: &mut Vec<CheckResult>) -> Result<()> {
    let a = k::acc(dtype);
    for (rows, width) in [(37usize, 200usize), (5, 1030)] {
        let x = normal(1, &[rows, width], dtype, device)?;
        let bias = normal(2, &[width], dtype, device)?;
        let residual = normal(3, &[rows, width], dtype, device)?;
        let gamma = ((normal(4, &[width], a, device)? * 0.5)? + 1.0)?;
        let beta = normal(5, &[width], a, device)?;
        let dy = normal(6, &[rows, width], dtype, device)?;
        let dropout = Some((11, 0.1));
        let (y, sum, stats) = k::add_norm_forward(
            &x,
            Some(&bias),
            Some(&residual),
            &gamma,
            &beta,
            1e-5,
            dropout,
            true,
        )?;
        let (y_r, sum_r, stats_r) = k::add_norm_forward(
            &cpu(&x)?,
            Some(&cpu(&bias)?),
            Some(&cpu(&residual)?),
            &cpu(&gamma)?,
            &cpu(&beta)?,
            1e-5,
            dropout,
            true,
        )?;
        let (sum, sum_r) = (sum.expect("kept"), sum_r.expect("kept"));
        let what = format!("add + dropout + LayerNorm forward [{rows}, {width}]");
        push(
            out,
            &what,
            dtype,
            worst(&[(&y, &y_r), (&sum, &sum_r), (&stats, &stats_r)])?,
        );
        let applied = k::norm_apply(&sum, &stats, &gamma, &beta, dtype)?;
        push(out, "LayerNorm from kept sums", dtype, rel(&applied, &y_r)?);
        let (dsum, dpre) = k::add_norm_backward(&dy, &sum, &stats, &gamma, dropout)?;
        let (dsum_r, dpre_r) = k::add_norm_backward(
            &cpu(&dy)?,
            &cpu(&sum)?,
            &cpu(&stats)?,
            &cpu(&gamma)?,
            dropout,
        )?;
        push(
            out,
            &format!("add + dropout + LayerNorm backward [{rows}, {width}]"),
            dtype,
            worst(&[(&dsum, &dsum_r), (&dpre, &dpre_r)])?,
        );
        let (dg, db) = k::norm_param_grads(&dy, &sum, &stats)?;
        let (dg_r, db_r) = k::norm_param_grads(&cpu(&dy)?, &cpu(&sum)?, &cpu(&stats)?)?;
        push(
            out,
            "LayerNorm parameter gradients",
            dtype,
            worst(&[(&dg, &dg_r), (&db, &db_r)])?,
        );
        push(
            out,
            "column sums",
            dtype,
            rel(&k::column_sums(&dy)?, &k::column_sums(&cpu(&dy)?)?)?,
        );
    }
    let u = normal(7, &[29, 300], dtype, device)?;
    let bias = normal(8, &[300], dtype, device)?;
    let dg = normal(9, &[29, 300], dtype, device)?;
    for act in [Act::GeluErf, Act::GeluTanh, Act::Relu, Act::Silu] {
        let (pre, g) = k::bias_act_forward(&u, &bias, act)?;
        let (pre_r, g_r) = k::bias_act_forward(&cpu(&u)?, &cpu(&bias)?, act)?;
        let back = k::act_backward(&dg, &pre, act)?;
        let back_r = k::act_backward(&cpu(&dg)?, &cpu(&pre)?, act)?;
        push(
            out,
            &format!("bias + {act:?} forward and backward"),
            dtype,
            worst(&[(&pre, &pre_r), (&g, &g_r), (&back, &back_r)])?,
        );
    }
    // RMSNorm (a row of a hidden state, and a head's row) and the gated unit.
    for (rows, width, offset) in [(23usize, 300usize, 0.0), (70, 64, 1.0)] {
        let x = normal(13, &[rows, width], dtype, device)?;
        let w = (normal(14, &[width], a, device)? * 0.3)?;
        let dy = normal(15, &[rows, width], dtype, device)?;
        let (y, r) = k::rms_forward(&x, &w, 1e-6, offset)?;
        let (y_r, r_r) = k::rms_forward(&cpu(&x)?, &cpu(&w)?, 1e-6, offset)?;
        let dx = k::rms_backward(&dy, &x, &r, &w, offset)?;
        let dx_r = k::rms_backward(&cpu(&dy)?, &cpu(&x)?, &cpu(&r)?, &cpu(&w)?, offset)?;
        let dw = k::rms_param_grads(&dy, &x, &r)?;
        let dw_r = k::rms_param_grads(&cpu(&dy)?, &cpu(&x)?, &cpu(&r)?)?;
        push(
            out,
            &format!("RMSNorm forward, backward, weight [{rows}, {width}]"),
            dtype,
            worst(&[(&y, &y_r), (&r, &r_r), (&dx, &dx_r), (&dw, &dw_r)])?,
        );
    }
    let up = normal(16, &[19, 2 * 150], dtype, device)?;
    let dout = normal(17, &[19, 150], dtype, device)?;
    for act in [Act::Silu, Act::GeluTanh] {
        let g = k::glu_forward(&up, act)?;
        let g_r = k::glu_forward(&cpu(&up)?, act)?;
        let back = k::glu_backward(&dout, &up, act)?;
        let back_r = k::glu_backward(&cpu(&dout)?, &cpu(&up)?, act)?;
        push(
            out,
            &format!("gated unit ({act:?}) forward and backward"),
            dtype,
            worst(&[(&g, &g_r), (&back, &back_r)])?,
        );
    }
    // Dropout: the same elements dropped on both devices (a count of disagreements:
    // must be 0), the kept ones scaled alike.
    let x = (normal(10, &[33, 257], dtype, device)?.abs()? + 1.0)?;
    let y = k::dropout(&x, 12345, 0.3)?;
    let y_r = k::dropout(&cpu(&x)?, 12345, 0.3)?;
    let zeros = |t: &Tensor| -> Result<Vec<bool>> {
        Ok(cpu(t)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| *v == 0.0)
            .collect())
    };
    let (mask, mask_r) = (zeros(&y)?, zeros(&y_r)?);
    let differ = mask.iter().zip(&mask_r).filter(|(a, b)| a != b).count();
    out.push(CheckResult {
        name: format!(
            "dropout masks, {}: elements dropped on one device only (of {})",
            name(dtype),
            mask.len()
        ),
        value: differ as f64,
        limit: 0.0,
    });
    push(out, "dropout values", dtype, rel(&y, &y_r)?);
    Ok(())
}

/// The softmax and head kernels.
fn attention(device: &Device, dtype: DType, out: &mut Vec<CheckResult>) -> Result<()> {
    let a = k::acc(dtype);
    let (n, heads, s, d) = (3usize, 2usize, 70usize, 8usize);
    let scores = normal(20, &[n, heads, s, s], dtype, device)?;
    // The last keys of the second text are padding.
    let mut mask = vec![0f32; n * s];
    for m in &mut mask[2 * s - 9..2 * s] {
        *m = crate::nn::MASKED_BIAS as f32;
    }
    let key_bias = Tensor::from_vec(mask, (n, s), &Device::Cpu)?
        .to_dtype(a)?
        .to_device(device)?;
    let score_bias = (normal(21, &[heads, s, s], a, device)? * 0.3)?;
    let dropout = Some((99, 0.1));
    let (p, pd) = k::softmax_forward(
        &scores,
        &key_bias,
        Some(&score_bias),
        0.35,
        dropout,
        (false, None),
    )?;
    let (p_r, pd_r) = k::softmax_forward(
        &cpu(&scores)?,
        &cpu(&key_bias)?,
        Some(&cpu(&score_bias)?),
        0.35,
        dropout,
        (false, None),
    )?;
    let (pd, pd_r) = (pd.expect("dropout"), pd_r.expect("dropout"));
    push(
        out,
        "masked softmax + dropout forward",
        dtype,
        worst(&[(&p, &p_r), (&pd, &pd_r)])?,
    );
    let grad = normal(22, &[n, heads, s, s], dtype, device)?;
    let dz = k::softmax_backward(&p, &grad, dropout)?;
    let dz_r = k::softmax_backward(&cpu(&p)?, &cpu(&grad)?, dropout)?;
    push(
        out,
        "masked softmax + dropout backward",
        dtype,
        rel(&dz, &dz_r)?,
    );

    let h = heads * d;
    let packed = normal(23, &[n * s, 3 * h], dtype, device)?;
    let bias = normal(24, &[3 * h], dtype, device)?;
    let shape = (n, heads, s, d);
    let mut worst_heads = 0f64;
    let mut parts = Vec::new();
    for (i, first) in [0, h, 2 * h].into_iter().enumerate() {
        let got = k::to_heads(&packed, first, shape, Some(&bias))?;
        let want = k::to_heads(&cpu(&packed)?, first, shape, Some(&cpu(&bias)?))?;
        worst_heads = worst_heads.max(rel(&got, &want)?);
        parts.push((got, first, if i == 2 { 1.0 } else { 0.35 }));
    }
    let refs: Vec<(&Tensor, usize, f64)> = parts.iter().map(|(t, c, m)| (t, *c, *m)).collect();
    let merged = k::from_heads(&refs, 3 * h)?;
    let cpu_parts: Vec<(Tensor, usize, f64)> = parts
        .iter()
        .map(|(t, c, m)| Ok((cpu(t)?, *c, *m)))
        .collect::<Result<_>>()?;
    let cpu_refs: Vec<(&Tensor, usize, f64)> =
        cpu_parts.iter().map(|(t, c, m)| (t, *c, *m)).collect();
    worst_heads = worst_heads.max(rel(&merged, &k::from_heads(&cpu_refs, 3 * h)?)?);
    push(out, "heads split (with bias) and merge", dtype, worst_heads);

    // A decoder's causal and windowed patterns, and rotary positions of left-padded rows.
    for pattern in [(true, None), (true, Some(5)), (false, Some(7))] {
        let (p, _) = k::softmax_forward(&scores, &key_bias, None, 0.35, None, pattern)?;
        let (p_r, _) =
            k::softmax_forward(&cpu(&scores)?, &cpu(&key_bias)?, None, 0.35, None, pattern)?;
        push(
            out,
            &format!(
                "masked softmax, causal {} window {:?}",
                pattern.0, pattern.1
            ),
            dtype,
            rel(&p, &p_r)?,
        );
    }
    let d = 16;
    let x = normal(25, &[n, heads, s, d], dtype, device)?;
    let positions: Vec<u32> = (0..n * s)
        .map(|i| (i % s).saturating_sub(3 * (i / s)) as u32)
        .collect();
    let positions = Tensor::from_vec(positions, n * s, &Device::Cpu)?.to_device(device)?;
    let angle = |i: usize| (i / d) as f64 * 0.1 * ((i % d) % (d / 2) + 1) as f64;
    let table = |f: fn(f64) -> f64| -> Result<Tensor> {
        let v: Vec<f32> = (0..s * d).map(|i| f(angle(i)) as f32).collect();
        Ok(Tensor::from_vec(v, (s, d), &Device::Cpu)?
            .to_dtype(a)?
            .to_device(device)?)
    };
    let (cos, sin) = (table(f64::cos)?, table(f64::sin)?);
    let y = k::rotary_forward(&x, &cos, &sin, &positions)?;
    let y_r = k::rotary_forward(&cpu(&x)?, &cpu(&cos)?, &cpu(&sin)?, &cpu(&positions)?)?;
    let dx = k::rotary_backward(&x, &cos, &sin, &positions, 0.5)?;
    let dx_r = k::rotary_backward(&cpu(&x)?, &cpu(&cos)?, &cpu(&sin)?, &cpu(&positions)?, 0.5)?;
    push(
        out,
        "rotary forward and backward",
        dtype,
        worst(&[(&y, &y_r), (&dx, &dx_r)])?,
    );
    Ok(())
}

/// AdamW and SGD on the device against the CPU's fused update: the same bits.
fn optimizer(device: &Device, out: &mut Vec<CheckResult>) -> Result<()> {
    let shapes: [&[usize]; 3] = [&[64, 48], &[48], &[1000, 3]];
    for (kind, label) in [
        (OptimizerKind::adamw(), "AdamW"),
        (OptimizerKind::Sgd, "SGD"),
    ] {
        let mut results = Vec::new();
        for dev in [device, &Device::Cpu] {
            let vars: Vec<(String, Var)> = shapes
                .iter()
                .enumerate()
                .map(|(i, shape)| {
                    let name = format!("layer.{i}.weight");
                    let t = normal(30 + i as u64, shape, DType::F32, dev)?;
                    Ok((name, Var::from_tensor(&t)?))
                })
                .collect::<Result<_>>()?;
            let params = Params::new(vars.clone());
            let mut optimizer = Optimizer::new(kind, params)?;
            for step in 0..3u64 {
                let grads: crate::Gradients = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, shape)| {
                        let g = normal(40 + 10 * step + i as u64, shape, DType::F32, dev)?;
                        Ok((format!("layer.{i}.weight"), g))
                    })
                    .collect::<Result<_>>()?;
                optimizer.step(step, &grads, 1e-2)?;
            }
            let values: Vec<u32> = vars
                .iter()
                .map(|(_, v)| -> Result<Vec<u32>> {
                    Ok(cpu(v.as_tensor())?
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|f| f.to_bits())
                        .collect())
                })
                .collect::<Result<Vec<_>>>()?
                .concat();
            results.push(values);
        }
        let differ = results[0]
            .iter()
            .zip(&results[1])
            .filter(|(a, b)| a != b)
            .count();
        out.push(CheckResult {
            name: format!("{label}, three updates: weights whose bits differ from the CPU's"),
            value: differ as f64,
            limit: 0.0,
        });
    }
    Ok(())
}

/// BERT's layer node: forward and every gradient on `device` against the node on the
/// CPU (f32: the kernels against their reference forms, the products of two devices) and
/// against the op-by-op layer on `device` (f32 and bf16).
fn layer_node(device: &Device, out: &mut Vec<CheckResult>) -> Result<()> {
    let (n, s, h, heads, inter) = (3usize, 11usize, 32usize, 4usize, 48usize);
    let on = |device: &Device, dtype: DType, gpu: bool| -> Result<(Tensor, crate::Gradients)> {
        crate::nn::set_gpu_nodes(gpu);
        crate::nn::run_gpu_nodes_on_cpu(gpu);
        let fused = crate::nn::fused_kernels();
        crate::nn::set_fused_kernels(false);
        let result = layer_step(device, dtype, (n, s, h, heads, inter));
        crate::nn::set_fused_kernels(fused);
        crate::nn::set_gpu_nodes(true);
        crate::nn::run_gpu_nodes_on_cpu(false);
        result
    };
    let skip = |name: &str| name == "bk";
    if !device.is_cpu() {
        let (y, grads) = on(device, DType::F32, true)?;
        let (y_cpu, grads_cpu) = on(&Device::Cpu, DType::F32, true)?;
        out.push(CheckResult {
            name: "BERT layer node, f32: output and gradients against the node on the CPU".into(),
            value: rel(&y, &y_cpu)?.max(relative_error(&grads, &grads_cpu, skip)?),
            limit: 1e-5,
        });
    }
    let (y32, grads32) = on(device, DType::F32, true)?;
    let (y_ops, grads_ops) = on(device, DType::F32, false)?;
    out.push(CheckResult {
        name: "BERT layer node, f32: output and gradients against the op-by-op layer".into(),
        value: rel(&y32, &y_ops)?.max(relative_error(&grads32, &grads_ops, skip)?),
        limit: 1e-5,
    });
    let (y16, grads16) = on(device, DType::BF16, true)?;
    out.push(CheckResult {
        name: "BERT layer node, bf16: output and gradients against the node in f32".into(),
        value: rel(&y16, &y32)?.max(relative_error(&grads16, &grads32, skip)?),
        limit: 5e-2,
    });
    decoder_node(device, out)
}

/// The decoder node's cached step on `device` against the op-by-op layers on `device`
/// (f32, bf16) and, off the CPU, against the node's step on the CPU (f32).
fn decoder_node(device: &Device, out: &mut Vec<CheckResult>) -> Result<()> {
    let step =
        |device: &Device, precision: crate::Precision, gpu: bool| -> Result<crate::Gradients> {
            crate::nn::set_gpu_nodes(gpu);
            crate::nn::run_gpu_nodes_on_cpu(gpu);
            let fused = crate::nn::fused_kernels();
            crate::nn::set_fused_kernels(false);
            let result = decoder_step(device, precision);
            crate::nn::set_fused_kernels(fused);
            crate::nn::set_gpu_nodes(true);
            crate::nn::run_gpu_nodes_on_cpu(false);
            result
        };
    let skip = |_: &str| false;
    if !device.is_cpu() {
        let (g, g_cpu) = (
            step(device, crate::Precision::F32, true)?,
            step(&Device::Cpu, crate::Precision::F32, true)?,
        );
        out.push(CheckResult {
            name: "decoder layer node, f32: a cached step's gradients against the node on the CPU"
                .into(),
            value: relative_error(&g, &g_cpu, skip)?,
            limit: 1e-5,
        });
    }
    let f32_node = step(device, crate::Precision::F32, true)?;
    out.push(CheckResult {
        name: "decoder layer node, f32: a cached step's gradients against the op-by-op layers"
            .into(),
        value: relative_error(
            &f32_node,
            &step(device, crate::Precision::F32, false)?,
            skip,
        )?,
        limit: 1e-5,
    });
    // bf16 rounds at other places in the node and op by op: each is held to the f32
    // node, and the node's error may be at most twice the op-by-op layers' (on the CPU,
    // where this tiny decoder's bf16 gradients are 4.4e-2 off f32 op by op, 1.16x).
    let node16 = relative_error(
        &step(device, crate::Precision::Bf16, true)?,
        &f32_node,
        skip,
    )?;
    let ops16 = relative_error(
        &step(device, crate::Precision::Bf16, false)?,
        &f32_node,
        skip,
    )?;
    out.push(CheckResult {
        name: format!(
            "decoder layer node, bf16: its gradients' error against f32 ({node16:.2e}) over the \
             op-by-op layers' ({ops16:.2e})"
        ),
        value: node16 / ops16.max(1e-3),
        limit: 2.0,
    });
    Ok(())
}

/// One cached two-tower step of [`super::TINY_QWEN3`] on `device` (last-token and mean pooling).
fn decoder_step(device: &Device, precision: crate::Precision) -> Result<crate::Gradients> {
    use crate::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
    let cfg: BertConfig =
        serde_json::from_str(super::TINY_QWEN3).map_err(|e| crate::Error::InvalidArgument {
            what: "self-check decoder config",
            value: e.to_string(),
            reason: "does not parse",
        })?;
    let store = crate::ParamStore::new(7, DType::F32, device);
    let options = |pooling| BertOptions {
        pooling,
        normalize: true,
        precision,
        ..Default::default()
    };
    let q = BertEncoder::build(&store, "query", &cfg, &options(Pooling::LastToken))?;
    let p = BertEncoder::build(&store, "passage", &cfg, &options(Pooling::Mean))?;
    let loss = crate::InfoNce::new(0.1)?.with_symmetric(true);
    let gc = crate::GradCache::two_towers(q, p, 3, 4, loss)?.with_seed(5);
    let left = |seed, rows| super::families::rows(seed, rows, true, device);
    Ok(gc.cache_step(2, &left(1, 6)?, &left(2, 12)?)?.grads)
}

/// One layer on `device` in `dtype` (f32 weights cast where used), dropout on, a padded
/// text: its output and every weight's and the input's gradient of `sum(y * c)`.
fn layer_step(
    device: &Device,
    dtype: DType,
    (n, s, h, heads, inter): (usize, usize, usize, usize, usize),
) -> Result<(Tensor, crate::Gradients)> {
    let shapes: [(&str, Vec<usize>); 16] = [
        ("wq", vec![h, h]),
        ("wk", vec![h, h]),
        ("wv", vec![h, h]),
        ("bq", vec![h]),
        ("bk", vec![h]),
        ("bv", vec![h]),
        ("wo", vec![h, h]),
        ("bo", vec![h]),
        ("g1", vec![h]),
        ("b1", vec![h]),
        ("wi", vec![inter, h]),
        ("bi", vec![inter]),
        ("wd", vec![h, inter]),
        ("bd", vec![h]),
        ("g2", vec![h]),
        ("b2", vec![h]),
    ];
    let vars: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let t = (normal(60 + i as u64, shape, DType::F32, device)? * 0.2)?;
            let t = if name.starts_with('g') { (t + 1.0)? } else { t };
            Ok(Var::from_tensor(&t)?)
        })
        .collect::<Result<_>>()?;
    let x = Var::from_tensor(&normal(80, &[n, s, h], dtype, device)?)?;
    let mut mask = vec![0f32; n * s];
    for m in &mut mask[2 * s - 4..2 * s] {
        *m = crate::nn::MASKED_BIAS as f32;
    }
    let bias = Tensor::from_vec(mask, (n, 1, 1, s), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    let w: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let weights = LayerWeights {
        qkv: [w[0], w[1], w[2]],
        qkv_bias: [w[3], w[4], w[5]],
        attention_output: (w[6], w[7]),
        attention_norm: (w[8], w[9]),
        intermediate: (w[10], w[11]),
        output: (w[12], w[13]),
        output_norm: (w[14], w[15]),
        lora: Default::default(),
    };
    let spec = LayerSpec {
        heads,
        act: Act::GeluErf,
        eps: 1e-12,
        attention: AttentionSpec {
            bias,
            scale: 1.0 / ((h / heads) as f64).sqrt(),
            dropout: Some((3, 0.1)),
            recompute: false,
            window: None,
        },
        attention_output_dropout: Some((4, 0.1)),
        output_dropout: Some((5, 0.1)),
        recompute_attention_norm: false,
        recompute_intermediate: false,
        recompute_output_norm: false,
        score_bias: None,
        relative: None,
    };
    let y = match crate::nn::encoder_layer(x.as_tensor(), &weights, &spec)? {
        Some(y) => y,
        None => crate::nn::gpu::encoder_layer_composed(x.as_tensor(), &weights, &spec)?,
    };
    let c = normal(81, &[n, s, h], DType::F32, device)?;
    let store = (y.to_dtype(DType::F32)? * c)?.sum_all()?.backward()?;
    let mut grads: Vec<(String, Tensor)> = shapes
        .iter()
        .zip(&vars)
        .filter_map(|((name, _), v)| {
            store
                .get(v.as_tensor())
                .map(|g| (name.to_string(), g.clone()))
        })
        .collect();
    if let Some(g) = store.get(x.as_tensor()) {
        grads.push(("x".into(), g.to_dtype(DType::F32)?));
    }
    Ok((y, grads.into_iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU every kernel check compares a reference form with itself: they must all
    /// run and pass (what a GPU runs is this code with CUDA tensors on one side).
    #[test]
    fn the_kernel_checks_run_and_pass_on_the_cpu() {
        let mut out = Vec::new();
        kernels(&Device::Cpu, &mut out).unwrap();
        layer_node(&Device::Cpu, &mut out).unwrap();
        assert_eq!(out.len(), 3 * 27 + 2 + 2 + 2, "{out:#?}");
        for r in &out {
            assert!(r.passed(), "{r:?}");
        }
    }
}
