//! How an encoding is cut into forward passes changes its speed and memory, not its
//! embeddings: `EmbeddingModel::embed` over texts of many lengths, one text per pass, a
//! number of texts per pass, and passes of up to a number of tokens (`Chunking::Tokens`,
//! `gradcache encode`'s default on the CPU), for an encoder (right padding) and a decoder
//! (left padding, last-token pooling). A budget of one token makes every text a pass
//! alone: the same passes as one text per pass, so the same bits. Other cuts give the
//! products other row counts, and the gemm crate may sum a product of a few rows in
//! another order than one of many (at these tiny widths it does): within 1e-6. 1,100
//! texts: more than one block of a budget of tokens (`hub::TOKEN_BLOCK_TEXTS`), and past
//! the count from which the products read transposed weights.

use gradcache::hub::{EmbeddingModel, LoadOptions, TOKEN_BLOCK_TEXTS};
use gradcache::Chunking;

use crate::common::families::fixture;
use crate::common::{bits, max_diff};

#[test]
fn every_way_of_cutting_an_encoding_into_passes_gives_the_same_embeddings() {
    // Lengths from the special tokens alone to past the fixtures' 32-token limit.
    let texts: Vec<String> = (0..1100)
        .map(|i| format!("verse {i} {}", "and it was so ".repeat(i % 11)))
        .collect();
    assert!(texts.len() > TOKEN_BLOCK_TEXTS);
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    for family in ["bert", "qwen3"] {
        let options = LoadOptions {
            max_len: Some(32),
            ..Default::default()
        };
        let model = EmbeddingModel::load(fixture(family).to_str().unwrap(), &options).unwrap();
        let alone = model.embed(&texts, 1).unwrap();
        let one_token = model.embed(&texts, Chunking::Tokens(1)).unwrap();
        assert!(
            bits(&one_token) == bits(&alone),
            "{family}: a budget of one token is not one text per pass"
        );
        for passes in [
            Chunking::Rows(7),
            Chunking::Tokens(100),
            Chunking::Tokens(512),
        ] {
            let got = model.embed(&texts, passes).unwrap();
            assert_eq!(got.dims(), alone.dims());
            let err = max_diff(&got, &alone);
            assert!(
                err <= 1e-6,
                "{family}: {passes:?} against one text per pass: {err:e}"
            );
        }
    }
}
