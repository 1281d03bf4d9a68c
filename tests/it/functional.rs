//! The functional form (`cached`, `cat_reps`, `Representations::push`): a training loop that
//! produces many micro-batches gets one big-batch loss and the big-batch gradients.

use candle_core::{DType, Device, Tensor};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{
    cached, cat_reps, Batch, Ctx, GradCache, InfoNce, Loss, ParamStore, Representations, Side,
    TokenBatch, Tower,
};

use crate::common;

fn features(seed: u64, rows: usize) -> Tensor {
    common::features(seed, rows, 10)
}

fn setup() -> (ParamStore, GradCache<Tower<Mlp>>) {
    let cfg = MlpConfig {
        input: 10,
        hidden: 16,
        output: 8,
        dropout: 0.0,
    };
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| Mlp::new(&cfg, vb)).unwrap();
    let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
    let gc = GradCache::shared(tower, 100, loss)
        .unwrap()
        .with_dropout(false);
    (store, gc)
}

#[test]
fn micro_batches_collected_into_one_loss_match_the_big_batch() {
    let (store, gc) = setup();
    let (q, p) = (features(1, 8), features(2, 16));
    let reference = gc.full_batch_step(0, &q, &p).unwrap();

    // Micro-batches of 3, 3, 2 queries with their 6, 6, 4 passages, as a data loader yields.
    let mut reps = Representations::new();
    for (start, len) in [(0, 3), (3, 3), (6, 2)] {
        let enc = gc.query_encoder();
        reps.push(enc, Side::Query, q.slice(start, len).unwrap(), Ctx::eval())
            .unwrap();
        reps.push(
            enc,
            Side::Passage,
            p.slice(2 * start, 2 * len).unwrap(),
            Ctx::eval(),
        )
        .unwrap();
    }
    let cache = reps.into_cache(gc.loss()).unwrap();
    assert!((cache.loss() - reference.loss).abs() / reference.loss < 1e-6);
    let out = cache.replay().unwrap();
    assert_eq!(out.grads.len(), store.params().len());
    let err = out.grads.max_rel_err(&reference.grads, 0.0).unwrap();
    assert!(err <= 1e-5, "max relative gradient error {err:e}");
}

#[test]
fn cached_and_cat_reps_by_hand() {
    let (_, gc) = setup();
    let (q, p) = (features(3, 6), features(4, 6));
    let reference = gc.full_batch_step(0, &q, &p).unwrap();
    let enc = gc.query_encoder();

    let qs: Vec<_> = [(0, 4), (4, 2)]
        .into_iter()
        .map(|(s, n)| cached(enc, Side::Query, q.slice(s, n).unwrap(), Ctx::eval()).unwrap())
        .collect();
    let ps = vec![cached(enc, Side::Passage, p.clone(), Ctx::eval()).unwrap()];
    let (qr, pr) = (cat_reps(&qs).unwrap(), cat_reps(&ps).unwrap());
    assert!(
        !qr.track_op() && !pr.track_op(),
        "cached representations carry no graph"
    );

    let value = gc.loss().value_and_grads(&qr, &pr).unwrap();
    let mut grads = gradcache::Gradients::default();
    let mut row = 0;
    for c in qs {
        let n = c.rep().dim(0).unwrap();
        grads
            .accumulate(
                c.replay(&value.grad_queries.narrow(0, row, n).unwrap())
                    .unwrap(),
            )
            .unwrap();
        row += n;
    }
    for c in ps {
        grads
            .accumulate(c.replay(&value.grad_passages).unwrap())
            .unwrap();
    }
    assert!(grads.max_rel_err(&reference.grads, 0.0).unwrap() <= 1e-5);
}

#[test]
fn chunks_cover_the_batch_in_order() {
    let x = features(5, 8);
    let sizes = |c| {
        x.chunks(c)
            .unwrap()
            .iter()
            .map(|t| t.rows())
            .collect::<Vec<_>>()
    };
    assert_eq!(sizes(3), vec![3, 3, 2]);
    assert_eq!(sizes(8), vec![8]);
    assert_eq!(sizes(20), vec![8]);
    assert_eq!(sizes(1), vec![1; 8]);
    let back = Tensor::cat(&x.chunks(3).unwrap(), 0).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
}

#[test]
fn token_batches_of_different_lengths_concatenate_with_padding() {
    let dev = &Device::Cpu;
    let a = TokenBatch::new(
        Tensor::new(&[[5u32, 6, 7]], dev).unwrap(),
        Tensor::new(&[[1u32, 1, 1]], dev).unwrap(),
        Tensor::new(&[[0u32, 0, 1]], dev).unwrap(),
    )
    .unwrap();
    let b = TokenBatch::new(
        Tensor::new(&[[8u32], [9]], dev).unwrap(),
        Tensor::new(&[[1u32], [1]], dev).unwrap(),
        Tensor::new(&[[0u32], [0]], dev).unwrap(),
    )
    .unwrap();
    let both = TokenBatch::cat(&[a, b]).unwrap();
    assert_eq!(both.rows(), 3);
    assert_eq!(
        both.input_ids.to_vec2::<u32>().unwrap(),
        vec![vec![5, 6, 7], vec![8, 0, 0], vec![9, 0, 0]]
    );
    assert_eq!(
        both.attention_mask.to_vec2::<u32>().unwrap(),
        vec![vec![1, 1, 1], vec![1, 0, 0], vec![1, 0, 0]]
    );
    assert_eq!(
        both.token_type_ids.to_vec2::<u32>().unwrap(),
        vec![vec![0, 0, 1], vec![0, 0, 0], vec![0, 0, 0]]
    );
    let parts = both.chunks(2).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.rows()).collect::<Vec<_>>(),
        vec![2, 1]
    );
    // Each chunk is trimmed to its own longest sequence.
    assert_eq!(
        parts[0].input_ids.to_vec2::<u32>().unwrap(),
        vec![vec![5, 6, 7], vec![8, 0, 0]]
    );
    assert_eq!(parts[1].input_ids.to_vec2::<u32>().unwrap(), vec![vec![9]]);
    assert_eq!(
        parts[1].attention_mask.to_vec2::<u32>().unwrap(),
        vec![vec![1]]
    );

    let bad = TokenBatch::new(
        Tensor::new(&[[1u32, 2]], dev).unwrap(),
        Tensor::new(&[[1u32]], dev).unwrap(),
        Tensor::new(&[[0u32, 0]], dev).unwrap(),
    );
    assert!(bad
        .unwrap_err()
        .to_string()
        .contains("attention_mask [1, 1]"));
}
