//! Dropout with explicit seeds: masks are a pure function of
//! (run seed, step, rank, tower, chunk, layer, site), identical in the representation pass
//! and the replay, and a cached step with dropout on equals a full-batch step that uses the
//! same masks.

use candle_core::{DType, Device, Tensor};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{
    Batch, ChunkSeed, Ctx, Dropout, Encoder, GradCache, Gradients, InfoNce, Loss, ParamStore, Side,
    Tower,
};

use crate::common;
use crate::common::{bits, Spy};

const B: usize = 10;

fn cfg() -> MlpConfig {
    MlpConfig {
        input: 12,
        hidden: 32,
        output: 16,
        dropout: 0.3,
    }
}

fn features(seed: u64, rows: usize) -> Tensor {
    common::features(seed, rows, 12)
}

fn seed() -> ChunkSeed {
    ChunkSeed {
        run: 42,
        step: 3,
        rank: 0,
        tower: 1,
        chunk: 2,
    }
}

#[test]
fn masks_are_a_pure_function_of_the_seed_tuple() {
    let x = Tensor::ones((64, 64), DType::F32, &Device::Cpu).unwrap();
    let drop = Dropout::new(0.5).unwrap();
    let mask = |s: ChunkSeed, layer: u32, site: u32| {
        bits(&drop.forward(&x, &Ctx::train(s), layer, site).unwrap())
    };
    let base = mask(seed(), 4, 1);
    assert_eq!(base, mask(seed(), 4, 1), "same tuple, same mask");

    let variants = [
        ("run", ChunkSeed { run: 43, ..seed() }, 4, 1),
        ("step", ChunkSeed { step: 4, ..seed() }, 4, 1),
        ("rank", ChunkSeed { rank: 1, ..seed() }, 4, 1),
        ("tower", ChunkSeed { tower: 0, ..seed() }, 4, 1),
        ("chunk", ChunkSeed { chunk: 3, ..seed() }, 4, 1),
        ("layer", seed(), 5, 1),
        ("site", seed(), 4, 2),
    ];
    for (what, s, layer, site) in variants {
        let other = mask(s, layer, site);
        let same = base.iter().zip(&other).filter(|(a, b)| a == b).count();
        // Two independent masks with p = 0.5 agree on about half the entries.
        let frac = same as f64 / base.len() as f64;
        assert!(
            (0.4..0.6).contains(&frac),
            "changing the {what} should draw a new mask (agreement {frac})"
        );
    }
}

#[test]
fn evaluation_and_zero_probability_are_the_identity() {
    let x = features(1, 8);
    let drop = Dropout::new(0.5).unwrap();
    assert_eq!(
        bits(&drop.forward(&x, &Ctx::eval(), 0, 0).unwrap()),
        bits(&x)
    );
    let none = Dropout::new(0.0).unwrap();
    assert_eq!(
        bits(&none.forward(&x, &Ctx::train(seed()), 0, 0).unwrap()),
        bits(&x)
    );
    assert_ne!(
        bits(&drop.forward(&x, &Ctx::train(seed()), 0, 0).unwrap()),
        bits(&x)
    );
}

#[test]
fn replay_reproduces_the_representation_pass_bit_for_bit() {
    let store = ParamStore::new(8, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| Mlp::new(&cfg(), vb)).unwrap();
    let tower = Spy::new(tower);
    let gc = GradCache::shared(tower, 3, InfoNce::new(0.1).unwrap())
        .unwrap()
        .with_seed(5);
    let (q, p) = (features(2, B), features(3, 2 * B));

    let reps = gc.represent(7, &q, &p).unwrap();
    let mut encoded = vec![];
    for (side, all) in [
        (Side::Query, reps.queries().unwrap()),
        (Side::Passage, reps.passages().unwrap()),
    ] {
        let chunks = all.chunks(3).unwrap();
        for (i, chunk) in chunks.into_iter().enumerate() {
            // Dropout is really on: the same chunk in evaluation differs.
            let input = if side == Side::Query { &q } else { &p };
            let eval = gc.query_encoder().encode(
                &input.slice(3 * i, chunk.dim(0).unwrap()).unwrap(),
                &Ctx::eval(),
            );
            assert_ne!(
                bits(&eval.unwrap()),
                bits(&chunk),
                "{side} chunk {i}: dropout had no effect"
            );
            encoded.push(chunk);
        }
    }
    reps.into_cache(gc.loss()).unwrap().replay().unwrap();

    let replayed = gc.query_encoder().forwards.borrow();
    assert_eq!(replayed.len(), encoded.len(), "one replay per chunk");
    for (i, (a, b)) in encoded.iter().zip(replayed.iter()).enumerate() {
        assert_eq!(
            bits(a),
            bits(b),
            "chunk {i}: replay differs from the representation pass"
        );
    }
}

/// The reference for dropout on: every chunk runs forward *with* a graph and its own
/// masks, the representations are concatenated, and one backward runs over the whole batch.
fn full_batch_with_chunk_masks<Q: Encoder, P: Encoder, L: Loss>(
    gc: &GradCache<Q, P, L>,
    step: u64,
    q: &Q::Input,
    p: &P::Input,
    chunks: (usize, usize),
) -> (f32, Gradients) {
    let forward_all =
        |enc: &dyn Fn(usize, &Ctx) -> Tensor, side: Side, rows: usize, chunk: usize| {
            let reps: Vec<Tensor> = (0..rows.div_ceil(chunk))
                .map(|i| enc(i, &gc.ctx(step, side, i)))
                .collect();
            Tensor::cat(&reps, 0).unwrap()
        };
    let (qc, pc) = chunks;
    let qr = forward_all(
        &|i, ctx| {
            let len = qc.min(q.rows() - i * qc);
            gc.query_encoder()
                .forward(&q.slice(i * qc, len).unwrap(), ctx)
                .unwrap()
        },
        Side::Query,
        q.rows(),
        qc,
    );
    let pr = forward_all(
        &|i, ctx| {
            let len = pc.min(p.rows() - i * pc);
            gc.passage_encoder()
                .forward(&p.slice(i * pc, len).unwrap(), ctx)
                .unwrap()
        },
        Side::Passage,
        p.rows(),
        pc,
    );
    let loss = gc.loss().forward(&qr, &pr).unwrap();
    let value = loss.to_scalar::<f32>().unwrap();
    (value, gc.params().grads_from(&loss.backward().unwrap()))
}

#[test]
fn cached_step_with_dropout_matches_full_batch_with_the_same_masks() {
    for (qc, pc) in [(1, 1), (3, 4), (B, 2 * B), (2 * B, 7)] {
        let store = ParamStore::new(9, DType::F32, &Device::Cpu);
        let q = Tower::build(&store, "query", |vb| Mlp::new(&cfg(), vb)).unwrap();
        let p = Tower::build(&store, "passage", |vb| Mlp::new(&cfg(), vb)).unwrap();
        let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
        let gc = GradCache::two_towers(q, p, qc, pc, loss)
            .unwrap()
            .with_seed(11);
        let (qs, ps) = (features(4, B), features(5, 2 * B));

        let (ref_loss, ref_grads) = full_batch_with_chunk_masks(&gc, 4, &qs, &ps, (qc, pc));
        let out = gc.cache_step(4, &qs, &ps).unwrap();
        assert!(
            ((out.loss - ref_loss) / ref_loss).abs() <= 1e-5,
            "chunks {qc}/{pc}: loss {} vs {ref_loss}",
            out.loss
        );
        assert_eq!(out.grads.len(), gc.params().len());
        let err = out.grads.max_rel_err(&ref_grads, 0.0).unwrap();
        assert!(
            err <= 1e-5,
            "chunks {qc}/{pc}: max relative gradient error {err:e}"
        );

        // And the masks matter: the same towers without dropout give other gradients.
        let q = Tower::build(&store, "query", |vb| Mlp::new(&cfg(), vb)).unwrap();
        let p = Tower::build(&store, "passage", |vb| Mlp::new(&cfg(), vb)).unwrap();
        let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
        let no_dropout = GradCache::two_towers(q, p, qc, pc, loss)
            .unwrap()
            .with_dropout(false);
        let plain = no_dropout.full_batch_step(4, &qs, &ps).unwrap();
        let off = out.grads.max_rel_err(&plain.grads, 0.0).unwrap();
        assert!(
            off > 1e-2,
            "chunks {qc}/{pc}: dropout changed nothing ({off:e})"
        );
    }
}
