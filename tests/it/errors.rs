//! Every bad input gets a typed error that names the problem, and nothing changes: no
//! chunk is replayed and no gradient is returned.

use candle_core::{DType, Device, Tensor};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{
    Ctx, Dropout, Encoder, Error, GradCache, InfoNce, Network, ParamStore, Side, Tower,
};

use crate::common::Spy;

fn cfg(output: usize) -> MlpConfig {
    MlpConfig {
        input: 6,
        hidden: 8,
        output,
        dropout: 0.0,
    }
}

fn tower(store: &ParamStore, prefix: &str, output: usize) -> Tower<Mlp> {
    Tower::build(store, prefix, |vb| Mlp::new(&cfg(output), vb)).unwrap()
}

fn store() -> ParamStore {
    ParamStore::new(0, DType::F32, &Device::Cpu)
}

fn features(rows: usize) -> Tensor {
    Tensor::ones((rows, 6), DType::F32, &Device::Cpu).unwrap()
}

fn loss() -> InfoNce {
    InfoNce::new(0.1).unwrap()
}

#[test]
fn zero_chunk_size() {
    let err = GradCache::shared(tower(&store(), "", 4), 0, loss())
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::ZeroChunkSize { side: Side::Query }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "chunk size of the query tower must be at least 1, got 0"
    );

    let s = store();
    let err = GradCache::two_towers(tower(&s, "q", 4), tower(&s, "p", 4), 2, 0, loss())
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            Error::ZeroChunkSize {
                side: Side::Passage
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("passage tower"));
}

#[test]
fn chunks_by_tokens_need_tokens() {
    let gc = GradCache::shared(tower(&store(), "", 4), 2, loss()).unwrap();
    let err = gc.with_chunk_tokens(8, 0).err().unwrap();
    assert!(
        matches!(
            err,
            Error::ZeroChunkSize {
                side: Side::Passage
            }
        ),
        "{err:?}"
    );
    // Feature tensors have no tokens to count: refused before any chunk is encoded.
    let gc = GradCache::shared(tower(&store(), "", 4), 2, loss())
        .unwrap()
        .with_chunk_tokens(8, 8)
        .unwrap();
    let err = gc.cache_step(0, &features(4), &features(4)).unwrap_err();
    assert!(
        matches!(err, Error::TokensToCount { side: Side::Query }),
        "{err:?}"
    );
    assert!(err.to_string().contains("train.chunk_tokens"), "{err}");
}

#[test]
fn empty_batch() {
    let gc = GradCache::shared(tower(&store(), "", 4), 2, loss()).unwrap();
    let err = gc.cache_step(0, &features(0), &features(4)).unwrap_err();
    assert!(
        matches!(err, Error::EmptyBatch { side: Side::Query }),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "empty batch: the query batch has no rows");
    let err = gc.cache_step(0, &features(4), &features(0)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::EmptyBatch {
                side: Side::Passage
            }
        ),
        "{err:?}"
    );
}

#[test]
fn passages_not_a_multiple_of_queries() {
    let gc = GradCache::shared(tower(&store(), "", 4), 2, loss()).unwrap();
    let err = gc.cache_step(0, &features(4), &features(6)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::PassagesNotMultiple {
                queries: 4,
                passages: 6
            }
        ),
        "{err:?}"
    );
    assert!(err
        .to_string()
        .starts_with("passages (6) must be a multiple of queries (4)"));
}

#[test]
fn towers_with_different_widths() {
    let s = store();
    let gc = GradCache::two_towers(tower(&s, "q", 4), tower(&s, "p", 5), 2, 2, loss()).unwrap();
    let err = gc.cache_step(0, &features(4), &features(4)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WidthMismatch {
                query: 4,
                passage: 5
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "towers return representations of different widths: queries have 4 columns, passages have 5"
    );
}

/// Counts replays, to show that a failed loss replays nothing.
#[test]
fn non_finite_loss_is_caught_before_any_gradient() {
    let enc = Spy::new(tower(&store(), "", 4));
    let gc = GradCache::shared(enc, 2, loss()).unwrap();
    let mut q = features(4).to_vec2::<f32>().unwrap();
    q[1][3] = f32::NAN;
    let q = Tensor::new(q, &Device::Cpu).unwrap();
    let err = gc.cache_step(0, &q, &features(4)).unwrap_err();
    assert!(
        matches!(err, Error::NonFiniteLoss { value } if value.is_nan()),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "non-finite loss (NaN); no gradient was computed or returned"
    );
    assert_eq!(
        gc.query_encoder().replays.get(),
        0,
        "no chunk may be replayed"
    );

    let err = gc.full_batch_step(0, &q, &features(4)).unwrap_err();
    assert!(matches!(err, Error::NonFiniteLoss { .. }), "{err:?}");
}

/// A broken network that loses the last row of every chunk.
struct DropsLastRow(Mlp);

impl Network for DropsLastRow {
    type Input = Tensor;
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> gradcache::Result<Tensor> {
        let rep = self.0.forward(x, ctx)?;
        Ok(rep.narrow(0, 0, rep.dim(0)? - 1)?)
    }
}

/// A broken network that returns a 3-D tensor.
struct ReturnsCube(Mlp);

impl Network for ReturnsCube {
    type Input = Tensor;
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> gradcache::Result<Tensor> {
        Ok(self.0.forward(x, ctx)?.unsqueeze(1)?)
    }
}

#[test]
fn representation_rows_differ_from_the_chunk() {
    let s = store();
    let enc = Tower::build(&s, "", |vb| Ok(DropsLastRow(Mlp::new(&cfg(4), vb)?))).unwrap();
    let gc = GradCache::shared(enc, 3, loss()).unwrap();
    let err = gc.cache_step(0, &features(4), &features(4)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::RowMismatch {
                side: Side::Query,
                expected: 3,
                got: 2
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "the query encoder returned 2 rows for a chunk of 3 inputs"
    );

    let enc = Tower::build(&s, "", |vb| Ok(ReturnsCube(Mlp::new(&cfg(4), vb)?))).unwrap();
    let gc = GradCache::shared(enc, 3, loss()).unwrap();
    let err = gc.cache_step(0, &features(4), &features(4)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotAMatrix {
                side: Side::Query,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn two_towers_with_colliding_parameter_names() {
    // Two stores, no prefixes: both towers own a different `fc1.weight`.
    let err = GradCache::two_towers(tower(&store(), "", 4), tower(&store(), "", 4), 2, 2, loss())
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::DuplicateParameter { ref name } if name == "fc1.bias"),
        "{err:?}"
    );
    assert!(err.to_string().contains("distinct name prefixes"));
}

#[test]
fn invalid_loss_and_dropout_settings() {
    for t in [0.0, -0.5, f64::NAN, f64::INFINITY] {
        let err = InfoNce::new(t).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    field: "temperature",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err
            .to_string()
            .starts_with(&format!("invalid value for `temperature`: {t}")));
    }
    let err = loss().with_block_rows(Some(0)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "block_rows",
                ..
            }
        ),
        "{err:?}"
    );
    for p in [1.0, -0.1, 1.5] {
        let err = Dropout::new(p).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    field: "dropout",
                    ..
                }
            ),
            "{err:?}"
        );
    }
}

#[test]
fn cotangent_of_the_wrong_shape() {
    let s = store();
    let t = tower(&s, "", 4);
    let err = t
        .replay(
            &features(3),
            &Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap(),
            &Ctx::eval(),
        )
        .unwrap_err();
    assert!(matches!(err, Error::CotangentShape { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "replay: the cotangent has shape [3, 5] but the output has shape [3, 4]"
    );
}
