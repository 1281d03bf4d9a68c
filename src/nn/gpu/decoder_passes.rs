//! The forward and backward passes of the GPU decoder layer node
//! ([`super::decoder_layer`]), written out in the order of the formulas of its
//! documentation, and what the forward keeps for the backward.

use candle_core::Tensor;

use super::decoder_layer::{
    Layer, BD, BG, BK, BO, BQ, BU, BV, IN_NORM, K_NORM, MLP_NORM, POST_ATTN, POST_MLP, Q_NORM, WD,
    WG, WK, WO, WQ, WU, WV,
};
use super::lora::{self, AdapterGrads};
use crate::nn::kernels as k;

/// What the forward keeps (`None`: recomputed in the backward).
pub(super) struct Kept {
    pub(super) r1: Tensor,
    pub(super) q0: Tensor,
    pub(super) rq: Option<Tensor>,
    pub(super) k0: Tensor,
    pub(super) rk: Option<Tensor>,
    pub(super) v: Tensor,
    pub(super) probs: Option<Tensor>,
    pub(super) ctx: Tensor,
    /// Gemma: the attention output under its norm, and that norm's statistic.
    pub(super) a: Option<(Tensor, Tensor)>,
    pub(super) x1: Tensor,
    pub(super) r2: Tensor,
    pub(super) up: Tensor,
    /// Gemma: the feed-forward output under its norm, and that norm's statistic.
    pub(super) m: Option<(Tensor, Tensor)>,
}

impl Layer {
    /// The layer's output `[n s, h]` and, when `keep`, what the backward reads.
    pub(super) fn forward(&self, keep: bool) -> candle_core::Result<(Tensor, Option<Kept>)> {
        let d = self.dims;
        let (n1, r1) = self.rms(&self.x, IN_NORM)?;
        let (wqkv, bqkv) = self.qkv()?;
        let qkv = n1.matmul(&wqkv.t()?)?;
        let qkv = match lora::stacked_delta(&self.qkv_adapters(), &n1)? {
            Some(delta) => (qkv + delta)?,
            None => qkv,
        };
        drop((n1, wqkv));
        let q0 = k::to_heads(&qkv, 0, (d.n, d.heads, d.s, d.d), bqkv.as_ref())?;
        let k0 = k::to_heads(&qkv, d.qd(), (d.n, d.kv_heads, d.s, d.d), bqkv.as_ref())?;
        let v = k::to_heads(
            &qkv,
            d.qd() + d.kd(),
            (d.n, d.kv_heads, d.s, d.d),
            bqkv.as_ref(),
        )?;
        drop(qkv);
        let ((q, rq), (kk, rk)) = self.rotated(&q0, &k0)?;
        let attention = self.attention();
        let (probs, dropped) = attention.probabilities(&q, &kk)?;
        drop((q, kk));
        let ctx = attention.context(dropped.as_ref().unwrap_or(&probs), &v)?;
        drop(dropped);
        let a_pre = self.linear(&ctx, WO, BO, 3)?;
        let (a, a_kept) = match self.w[POST_ATTN] {
            Some(_) => {
                let (a, r) = self.rms(&a_pre, POST_ATTN)?;
                (a, Some((a_pre, r)))
            }
            None => (a_pre, None),
        };
        let x1 = (&self.x + a)?;
        let (n2, r2) = self.rms(&x1, MLP_NORM)?;
        let (wgu, bgu) = self.gate_up()?;
        let up = n2.matmul(&wgu.t()?)?;
        let inter = wgu.dim(0)? / 2;
        let up = match lora::stacked_delta(&self.gate_up_adapters(inter), &n2)? {
            Some(delta) => (up + delta)?,
            None => up,
        };
        let up = match bgu {
            Some(b) => up.broadcast_add(&b)?,
            None => up,
        };
        drop((n2, wgu));
        let gated = k::glu_forward(&up, self.spec.act)?;
        let m_pre = self.linear(&gated, WD, BD, 6)?;
        drop(gated);
        let (m, m_kept) = match self.w[POST_MLP] {
            Some(_) => {
                let (m, r) = self.rms(&m_pre, POST_MLP)?;
                (m, Some((m_pre, r)))
            }
            None => (m_pre, None),
        };
        let y = (&x1 + m)?;
        if !keep {
            return Ok((y, None));
        }
        Ok((
            y,
            Some(Kept {
                r1,
                q0,
                rq,
                k0,
                rk,
                v,
                probs: (!self.spec.attention.recompute).then_some(probs),
                ctx,
                a: a_kept,
                x1,
                r2,
                up,
                m: m_kept,
            }),
        ))
    }

    /// Every input's gradient from the output's, in node-input order; `None` where `wants`
    /// says the input takes none.
    pub(super) fn backward(
        &self,
        dy: &Tensor,
        kept: &Option<Kept>,
        wants: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let Some(kept) = kept else {
            candle_core::bail!("decoder layer: backward without the forward's tensors");
        };
        let d = self.dims;
        let offset = self.spec.offset;
        let dy = dy
            .to_dtype(self.dtype)?
            .reshape((d.rows(), d.h))?
            .contiguous()?;
        let want = |slot: usize| {
            self.input_of[slot]
                .and_then(|i| wants.get(i).copied())
                .unwrap_or(false)
        };
        let mut grads: Vec<Option<Tensor>> = vec![None; wants.len()];
        let mut put = |slot: usize, t: Tensor| -> candle_core::Result<()> {
            if let (true, Some(i), Some(w)) = (want(slot), self.input_of[slot], &self.w[slot]) {
                grads[i] = Some(t.to_dtype(w.dtype())?);
            }
            Ok(())
        };
        let rms_back =
            |dy: &Tensor, x: &Tensor, r: &Tensor, slot: usize| -> candle_core::Result<Tensor> {
                let w = self.norm(slot)?.expect("a norm in this slot");
                k::rms_backward(dy, x, r, &w, offset)
            };

        // The feed-forward.
        let dm = match &kept.m {
            Some((m, r)) => {
                if want(POST_MLP) {
                    put(POST_MLP, k::rms_param_grads(&dy, m, r)?)?;
                }
                rms_back(&dy, m, r, POST_MLP)?
            }
            None => dy.clone(),
        };
        if want(BD) {
            put(BD, k::column_sums(&dm)?)?;
        }
        let mut adapter_grads: Vec<(usize, AdapterGrads)> = Vec::new();
        let mut dgated = dm.matmul(&self.weight(WD)?)?;
        if want(WD) || self.adapters[6].is_some() {
            let gated = k::glu_forward(&kept.up, self.spec.act)?;
            if want(WD) {
                put(WD, dm.t()?.matmul(&gated)?)?;
            }
            if let Some(a) = &self.adapters[6] {
                let g = a.backward(&dm, &gated)?;
                dgated = (dgated + &g.x)?;
                adapter_grads.push((6, g));
            }
        }
        drop(dm);
        let dup = k::glu_backward(&dgated, &kept.up, self.spec.act)?;
        drop(dgated);
        let (n2, _) = self.rms(&kept.x1, MLP_NORM)?;
        if want(BG) || want(BU) {
            let db = k::column_sums(&dup)?;
            let inter = db.dim(0)? / 2;
            put(BG, db.narrow(0, 0, inter)?)?;
            put(BU, db.narrow(0, inter, inter)?)?;
        }
        if want(WG) || want(WU) {
            let dw = dup.t()?.matmul(&n2)?;
            let inter = dw.dim(0)? / 2;
            put(WG, dw.narrow(0, 0, inter)?.contiguous()?)?;
            put(WU, dw.narrow(0, inter, inter)?.contiguous()?)?;
        }
        let (wgu, _) = self.gate_up()?;
        let inter = wgu.dim(0)? / 2;
        let (gu_grads, gu_dx) = lora::stacked_backward(&self.gate_up_adapters(inter), &dup, &n2)?;
        for (p, g) in gu_grads.into_iter().enumerate() {
            if let Some(g) = g {
                adapter_grads.push((4 + p, g));
            }
        }
        drop(n2);
        let dn2 = lora::plus(dup.matmul(&wgu)?, gu_dx)?;
        drop((dup, wgu));
        if want(MLP_NORM) {
            put(MLP_NORM, k::rms_param_grads(&dn2, &kept.x1, &kept.r2)?)?;
        }
        let dx1 = (rms_back(&dn2, &kept.x1, &kept.r2, MLP_NORM)? + &dy)?;
        drop((dn2, dy));

        // The attention output.
        let da = match &kept.a {
            Some((a, r)) => {
                if want(POST_ATTN) {
                    put(POST_ATTN, k::rms_param_grads(&dx1, a, r)?)?;
                }
                rms_back(&dx1, a, r, POST_ATTN)?
            }
            None => dx1.clone(),
        };
        if want(BO) {
            put(BO, k::column_sums(&da)?)?;
        }
        if want(WO) {
            put(WO, da.t()?.matmul(&kept.ctx)?)?;
        }
        let mut dctx = da.matmul(&self.weight(WO)?)?;
        if let Some(a) = &self.adapters[3] {
            let g = a.backward(&da, &kept.ctx)?;
            dctx = (dctx + &g.x)?;
            adapter_grads.push((3, g));
        }
        drop(da);

        // The attention.
        let ((q, _), (kk, _)) = self.rotated(&kept.q0, &kept.k0)?;
        let grads_attention =
            self.attention()
                .backward(&dctx, (&q, &kk, &kept.v), kept.probs.as_ref(), false)?;
        drop((dctx, q, kk));
        let (dq, dk, dv) = (grads_attention.q, grads_attention.k, grads_attention.v);
        let scale = self.spec.attention.scale;
        let dq = k::rotary_backward(&dq, &self.cos, &self.sin, &self.positions, scale)?;
        let dk = k::rotary_backward(&dk, &self.cos, &self.sin, &self.positions, scale)?;
        let mut head_norm_back = |t: Tensor,
                                  t0: &Tensor,
                                  r: &Option<Tensor>,
                                  slot: usize|
         -> candle_core::Result<Tensor> {
            let Some(r) = r else { return Ok(t) };
            let rows = t.elem_count() / d.d;
            let (t2, t02) = (t.reshape((rows, d.d))?, t0.reshape((rows, d.d))?);
            if want(slot) {
                put(slot, k::rms_param_grads(&t2, &t02, r)?)?;
            }
            rms_back(&t2, &t02, r, slot)?.reshape(t.shape())
        };
        let dq0 = head_norm_back(dq, &kept.q0, &kept.rq, Q_NORM)?;
        let dk0 = head_norm_back(dk, &kept.k0, &kept.rk, K_NORM)?;
        let width = d.qd() + 2 * d.kd();
        let dqkv = k::from_heads(
            &[
                (&dq0, 0, 1.0),
                (&dk0, d.qd(), 1.0),
                (&dv, d.qd() + d.kd(), 1.0),
            ],
            width,
        )?;
        drop((dq0, dk0, dv));
        let splits = [
            (WQ, BQ, 0, d.qd()),
            (WK, BK, d.qd(), d.kd()),
            (WV, BV, d.qd() + d.kd(), d.kd()),
        ];
        if splits.iter().any(|&(_, b, _, _)| want(b)) {
            let db = k::column_sums(&dqkv)?;
            for &(_, b, at, len) in &splits {
                put(b, db.narrow(0, at, len)?)?;
            }
        }
        let (n1, _) = self.rms(&self.x, IN_NORM)?;
        if splits.iter().any(|&(w, _, _, _)| want(w)) {
            let dw = dqkv.t()?.matmul(&n1)?;
            for &(w, _, at, len) in &splits {
                put(w, dw.narrow(0, at, len)?.contiguous()?)?;
            }
        }
        let (qkv_grads, qkv_dx) = lora::stacked_backward(&self.qkv_adapters(), &dqkv, &n1)?;
        for (p, g) in qkv_grads.into_iter().enumerate() {
            if let Some(g) = g {
                adapter_grads.push((p, g));
            }
        }
        let (wqkv, _) = self.qkv()?;
        let dn1 = lora::plus(dqkv.matmul(&wqkv)?, qkv_dx)?;
        drop((dqkv, wqkv));
        if want(IN_NORM) {
            put(IN_NORM, k::rms_param_grads(&dn1, &self.x, &kept.r1)?)?;
        }
        drop(n1);
        if wants.first().copied().unwrap_or(false) {
            let dx = (rms_back(&dn1, &self.x, &kept.r1, IN_NORM)? + dx1)?;
            grads[0] = Some(dx.reshape((d.n, d.s, d.h))?);
        }
        for (p, g) in adapter_grads {
            if let Some(i) = self.adapter_input[p] {
                grads[i] = Some(g.a);
                grads[i + 1] = Some(g.b);
            }
        }
        Ok(grads)
    }
}
