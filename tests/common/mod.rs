//! Fixtures shared by the integration tests.

use std::path::Path;

use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;

pub const VOCAB: [&str; 12] = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "lord", "is", "my", "shepherd", "##s", "light", ",",
];

/// A small WordPiece tokenizer with BERT's normaliser, pre-tokenizer and `[CLS] .. [SEP]`.
pub fn write_tokenizer(path: &Path) {
    let vocab: [(String, u32); 12] = std::array::from_fn(|i| (VOCAB[i].to_string(), i as u32));
    let model = WordPiece::builder()
        .vocab(vocab)
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_normalizer(Some(BertNormalizer::default()))
        .unwrap();
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_post_processor(Some(BertProcessing::new(
        ("[SEP]".into(), 3),
        ("[CLS]".into(), 2),
    )));
    tok.save(path, false).unwrap();
}
