//! Building a [`Bert`]: the weights of each family under its Hugging Face names, fresh
//! from the store's seed or read from a pretrained model's files, and the `Dense` modules
//! after the pooling.

use super::*;

/// Where a post-norm family keeps its layers' weights (Hugging Face module names).
struct LayerNames {
    /// The layers' list: `{layers}.{i}`.
    layers: &'static str,
    /// Under a layer: the query, key, value and attention output projections, the
    /// feed-forward's up and down projections.
    projections: [&'static str; 6],
    attention_norm: &'static str,
    output_norm: &'static str,
}

impl LayerNames {
    fn of(family: Family) -> Self {
        match family {
            Family::MpNet => Self {
                layers: "encoder.layer",
                projections: [
                    "attention.attn.q",
                    "attention.attn.k",
                    "attention.attn.v",
                    "attention.attn.o",
                    "intermediate.dense",
                    "output.dense",
                ],
                attention_norm: "attention.LayerNorm",
                output_norm: "output.LayerNorm",
            },
            Family::DistilBert => Self {
                layers: "transformer.layer",
                projections: [
                    "attention.q_lin",
                    "attention.k_lin",
                    "attention.v_lin",
                    "attention.out_lin",
                    "ffn.lin1",
                    "ffn.lin2",
                ],
                attention_norm: "sa_layer_norm",
                output_norm: "output_layer_norm",
            },
            Family::DebertaV2 => Self {
                layers: "encoder.layer",
                projections: [
                    "attention.self.query_proj",
                    "attention.self.key_proj",
                    "attention.self.value_proj",
                    "attention.output.dense",
                    "intermediate.dense",
                    "output.dense",
                ],
                attention_norm: "attention.output.LayerNorm",
                output_norm: "output.LayerNorm",
            },
            _ => Self {
                layers: "encoder.layer",
                projections: [
                    "attention.self.query",
                    "attention.self.key",
                    "attention.self.value",
                    "attention.output.dense",
                    "intermediate.dense",
                    "output.dense",
                ],
                attention_norm: "attention.output.LayerNorm",
                output_norm: "output.LayerNorm",
            },
        }
    }
}

impl Bert {
    /// Builds the model under `vb` with Hugging Face names (`embeddings.*`,
    /// `encoder.layer.{i}.*`; DistilBERT's `transformer.layer.{i}.*`). Fresh weights: normal(0, `initializer_range`), LayerNorm
    /// ones and zeros, biases zero, as Hugging Face initialises BERT.
    pub fn new(cfg: &BertConfig, options: &BertOptions, vb: VarBuilder) -> Result<Self> {
        let path = Path::new("config");
        cfg.validate(path)?;
        let (h, std, eps) = (cfg.hidden_size, cfg.initializer_range, cfg.layer_norm_eps);
        let lora = options.lora.as_ref();
        let linear = |i: usize, o: usize, vb: VarBuilder| {
            Linear::normal(i, o, std, vb.clone())?.adapted(lora, &vb)
        };
        let family = cfg.family(path)?;
        if options.sparse.is_some() {
            if crate::models::sparse::MlmNames::of(family).is_none() {
                return Err(Error::UnsupportedConfig {
                    field: "model_type",
                    value: cfg.model_type.clone().unwrap_or_else(|| "bert".into()),
                    supported: crate::models::sparse::SPARSE_FAMILIES,
                    path: path.to_path_buf(),
                });
            }
            if options.multi_vector || !options.dense.is_empty() {
                return Err(Error::InvalidArgument {
                    what: "sparse model",
                    value: format!(
                        "multi-vector: {}, Dense modules: {}",
                        options.multi_vector,
                        options.dense.len()
                    ),
                    reason: "a sparse (SPLADE) model's vector is its MLM head's pooled \
                             logits: no multi-vector head, no Dense modules",
                });
            }
        }
        if options.classifier.is_some()
            && (options.sparse.is_some() || options.multi_vector || !options.dense.is_empty())
        {
            return Err(Error::InvalidArgument {
                what: "cross-encoder",
                value: format!(
                    "sparse: {}, multi-vector: {}, Dense modules: {}",
                    options.sparse.is_some(),
                    options.multi_vector,
                    options.dense.len()
                ),
                reason: "a cross-encoder's output is its classification head's logits: no \
                         sparse or multi-vector head, no Dense modules",
            });
        }
        let head = |words: Option<&candle_core::Tensor>| -> Result<Option<ClassifierHead>> {
            match options.classifier {
                Some(spec) => Ok(Some(ClassifierHead::new(
                    cfg,
                    spec,
                    layer_id(cfg.num_hidden_layers),
                    &vb,
                    words,
                )?)),
                None => Ok(None),
            }
        };
        let dense = dense_modules(h, &options.dense, &vb)?;
        if family.is_decoder() {
            let decoder = Decoder::new(cfg, cfg.decoder(path)?, options.lora.as_ref(), vb.clone())?;
            let classifier = head(Some(decoder.word_embeddings()))?;
            return Ok(Self {
                embeddings: None,
                layers: Vec::new(),
                modern: None,
                decoder: Some(Box::new(decoder)),
                rotary: None,
                relative_bias: None,
                disentangled: None,
                heads: cfg.num_attention_heads,
                first_position: 0,
                max_positions: cfg.max_tokens(),
                activation: Activation::Gelu,
                hidden_dropout: Dropout::new(0.0)?,
                attention_dropout: Dropout::new(0.0)?,
                attention_output_dropout: Dropout::new(0.0)?,
                options: options.clone(),
                dense,
                sparse: None,
                classifier,
            });
        }
        let classifier = head(None)?;
        if family.is_rotary_post_norm() {
            let rotary = RotaryEncoder::new(cfg, cfg.rotary(path)?, options.lora.as_ref(), vb)?;
            return Ok(Self {
                embeddings: None,
                layers: Vec::new(),
                modern: None,
                decoder: None,
                rotary: Some(Box::new(rotary)),
                relative_bias: None,
                disentangled: None,
                heads: cfg.num_attention_heads,
                first_position: 0,
                max_positions: cfg.max_tokens(),
                activation: cfg.activation(path)?,
                hidden_dropout: Dropout::new(0.0)?,
                attention_dropout: Dropout::new(0.0)?,
                attention_output_dropout: Dropout::new(0.0)?,
                options: options.clone(),
                dense,
                sparse: None,
                classifier,
            });
        }
        if family == Family::ModernBert {
            let modern = ModernBert::new(cfg, &cfg.modern(path)?, options.lora.as_ref(), vb)?;
            return Ok(Self {
                embeddings: None,
                layers: Vec::new(),
                modern: Some(Box::new(modern)),
                decoder: None,
                rotary: None,
                relative_bias: None,
                disentangled: None,
                heads: cfg.num_attention_heads,
                first_position: 0,
                max_positions: cfg.max_tokens(),
                activation: cfg.activation(path)?,
                hidden_dropout: Dropout::new(0.0)?,
                attention_dropout: Dropout::new(0.0)?,
                attention_output_dropout: Dropout::new(0.0)?,
                options: options.clone(),
                dense,
                sparse: None,
                classifier,
            });
        }
        let e = vb.pp("embeddings");
        let deberta = match family {
            Family::DebertaV2 => Some(cfg.deberta(path)?),
            _ => None,
        };
        let token_types = match family {
            Family::MpNet | Family::DistilBert => None,
            Family::DebertaV2 if cfg.type_vocab_size == 0 => None,
            _ => Some(embedding(
                cfg.type_vocab_size,
                h,
                std,
                e.pp("token_type_embeddings"),
            )?),
        };
        let embeddings = Embeddings {
            words: embedding(cfg.vocab_size, h, std, e.pp("word_embeddings"))?,
            positions: match &deberta {
                Some(d) if !d.absolute_positions => None,
                _ => Some(embedding(
                    cfg.max_position_embeddings,
                    h,
                    std,
                    e.pp("position_embeddings"),
                )?),
            },
            token_types,
            norm: LayerNorm::new(h, eps, e.pp("LayerNorm"))?,
        };
        let names = LayerNames::of(family);
        let sparse = match options.sparse {
            Some(spec) => Some(MlmHead::new(
                cfg,
                spec,
                embeddings.words.embeddings().clone(),
                &vb,
            )?),
            None => None,
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format!("{}.{i}", names.layers));
                let at = |name: &str| name.split('.').fold(l.clone(), |vb, part| vb.pp(part));
                let [q, k, v, o, up, down] = names.projections;
                Ok(Layer {
                    query: linear(h, h, at(q))?,
                    key: linear(h, h, at(k))?,
                    value: linear(h, h, at(v))?,
                    attention_output: linear(h, h, at(o))?,
                    attention_norm: LayerNorm::new(h, eps, at(names.attention_norm))?,
                    intermediate: linear(h, cfg.intermediate_size, at(up))?,
                    output: linear(cfg.intermediate_size, h, at(down))?,
                    output_norm: LayerNorm::new(h, eps, at(names.output_norm))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let relative_bias = match family {
            Family::MpNet => {
                let buckets = cfg.relative_attention_buckets();
                let table = embedding(
                    buckets,
                    cfg.num_attention_heads,
                    std,
                    vb.pp("encoder").pp("relative_attention_bias"),
                )?;
                Some(RelativeBias { table, buckets })
            }
            _ => None,
        };
        let disentangled = match deberta.and_then(|d| d.relative) {
            Some(relative) => Some(Disentangled::new(
                relative,
                (
                    cfg.num_hidden_layers,
                    h,
                    eps,
                    std,
                    cfg.hidden_dropout_prob as f32,
                ),
                lora,
                &vb,
            )?),
            None => None,
        };
        Ok(Self {
            embeddings: Some(embeddings),
            layers,
            modern: None,
            decoder: None,
            rotary: None,
            relative_bias,
            disentangled,
            heads: cfg.num_attention_heads,
            first_position: cfg.first_position(),
            max_positions: cfg.max_tokens(),
            activation: cfg.activation(path)?,
            hidden_dropout: Dropout::new(cfg.hidden_dropout_prob as f32)?,
            attention_dropout: Dropout::new(cfg.attention_probs_dropout_prob as f32)?,
            attention_output_dropout: Dropout::new(match family {
                Family::DistilBert => 0.0,
                _ => cfg.hidden_dropout_prob as f32,
            })?,
            options: options.clone(),
            dense,
            sparse,
            classifier,
        })
    }
}

fn embedding(rows: usize, width: usize, std: f64, vb: VarBuilder) -> Result<Embedding> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: std,
    };
    Ok(Embedding::new(
        vb.get_with_hints((rows, width), "weight", init)?,
        width,
    ))
}

/// The `Dense` modules of `specs` under `vb`, each taking the previous one's output (the
/// first, the pooled `hidden` width).
fn dense_modules(hidden: usize, specs: &[DenseSpec], vb: &VarBuilder) -> Result<Vec<Dense>> {
    let mut width = hidden;
    specs
        .iter()
        .map(|spec| {
            let named = !spec.path.is_empty() && !spec.path.contains(['.', '/', '\\']);
            if spec.in_features != width || !named {
                return Err(Error::InvalidArgument {
                    what: "Dense module",
                    value: format!(
                        "`{}` ({} -> {})",
                        spec.path, spec.in_features, spec.out_features
                    ),
                    reason: "each Dense module takes the previous output's width (the first, \
                             the hidden size) and is a directory of the model (a name \
                             without `.` or `/`)",
                });
            }
            width = spec.out_features;
            Dense::new(spec, vb.clone())
        })
        .collect()
}

impl Recomputed<Bert> {
    /// Builds a BERT tower over `store` (names under `prefix`, `""` for a shared tower):
    /// variables the store serves from a weights file are loaded, others are initialised
    /// from the store's seed.
    pub fn build(
        store: &ParamStore,
        prefix: &str,
        cfg: &BertConfig,
        options: &BertOptions,
    ) -> Result<Self> {
        let tower = Tower::build(store, prefix, |vb| Bert::new(cfg, options, vb))?;
        sinusoidal_positions(store, prefix, cfg)?;
        Recomputed::new(tower, options.recompute.clone())
    }
}

/// DistilBERT's `sinusoidal_pos_embds`: a fresh position table starts from the sinusoids
/// transformers writes there (column `j` of position `p`: the sine (even `j`) or cosine
/// (odd `j`) of `p / 10000^(2 floor(j / 2) / dim)`, in f64 rounded to f32) and trains from
/// them as transformers 5 trains it; a table read from a file stays as it is.
fn sinusoidal_positions(store: &ParamStore, prefix: &str, cfg: &BertConfig) -> Result<()> {
    if !cfg.sinusoidal_positions() {
        return Ok(());
    }
    let name = match prefix {
        "" => "embeddings.position_embeddings.weight".to_string(),
        p => format!("{p}.embeddings.position_embeddings.weight"),
    };
    let Some(var) = store.get(&name).filter(|_| !store.reads_from_file(&name)) else {
        return Ok(());
    };
    let (rows, dim) = var.dims2()?;
    let table: Vec<f32> = (0..rows)
        .flat_map(|p| {
            (0..dim).map(move |j| {
                let angle = p as f64 / 10_000f64.powf((2 * (j / 2)) as f64 / dim as f64);
                (if j % 2 == 0 { angle.sin() } else { angle.cos() }) as f32
            })
        })
        .collect();
    let table = Tensor::from_vec(table, (rows, dim), var.device())?.to_dtype(var.dtype())?;
    var.set(&table)?;
    Ok(())
}

/// `store` reading the names under `prefix` from a pretrained model's files: its weights
/// (under the base name `BertFor...`, `RobertaFor...`, `...ForCausalLM` checkpoints keep
/// them under) and each Dense module's from its directory; as fallbacks (`fallback`) for
/// names a checkpoint read first lacks (the frozen weights of a LoRA run).
pub fn with_model_weights(
    files: &ModelFiles,
    prefix: &str,
    options: &BertOptions,
    store: ParamStore,
    fallback: bool,
) -> Result<ParamStore> {
    let probe = WeightFile::open(&files.weights, "")?;
    let file_prefix = [
        "bert.",
        "roberta.",
        "mpnet.",
        "distilbert.",
        "deberta.",
        "model.",
        "new.",
    ]
    .into_iter()
    .find(|p| {
        [
            "embeddings.word_embeddings.weight",
            "embeddings.tok_embeddings.weight",
            "embed_tokens.weight",
        ]
        .iter()
        .any(|t| {
            // Jina v3's release keeps its tables parametrized (the task adapters').
            let parametrized = t.replace(".weight", ".parametrizations.weight.original");
            probe.contains(&format!("{p}{t}")) || probe.contains(&format!("{p}{parametrized}"))
        })
    })
    .unwrap_or("");
    let add = |store: ParamStore, prefix: &str, file: WeightFile| match fallback {
        true => store.with_fallback_weights(prefix, Arc::new(file)),
        false => store.with_weights(prefix, Arc::new(file)),
    };
    let mut store = add(
        store,
        prefix,
        WeightFile::open(&files.weights, file_prefix)?,
    );
    // A head beside the base model in the file, each module under its own name: a
    // sparse model's MLM head (`cls.*`, `vocab_transform.*`, ...), a cross-encoder's
    // classification head (`classifier.*`, `head.*`, ...).
    if options.sparse.is_some() || options.classifier.is_some() {
        let cfg = BertConfig::from_file(&files.config)?;
        let family = cfg.family(&files.config)?;
        let mut modules: Vec<&str> = Vec::new();
        if options.sparse.is_some() {
            if let Some(names) = crate::models::sparse::MlmNames::of(family) {
                modules.extend(names.modules);
            }
        }
        if let Some(spec) = options.classifier {
            modules.extend(crate::models::classifier::head_modules(
                &cfg, family, spec.kind,
            ));
        }
        for module in modules {
            let name = match prefix {
                "" => module.to_string(),
                p => format!("{p}.{module}"),
            };
            store = add(
                store,
                &name,
                WeightFile::open(&files.weights, &format!("{module}."))?,
            );
        }
    }
    for dense in &options.dense {
        let weights = files.dir.join(&dense.path).join("model.safetensors");
        let module = match prefix {
            "" => dense.path.clone(),
            p => format!("{p}.{}", dense.path),
        };
        store = add(store, &module, WeightFile::open(&weights, "")?);
    }
    Ok(store)
}

/// Creates the variables of the `Dense` modules `specs` under `prefix` in `store`, drawn
/// from its seed: a projection a model's files do not have (the one a multi-vector run
/// adds), created before a weights file serves the names around it.
pub fn create_dense(store: &ParamStore, prefix: &str, specs: &[DenseSpec]) -> Result<()> {
    for spec in specs {
        Tower::build(store, prefix, |vb| Dense::new(spec, vb))?;
    }
    Ok(())
}

/// Creates the variables of `cfg`'s masked-language-model head under `prefix` in `store`,
/// drawn from its seed as transformers initialises them: the head of a sparse run over a
/// model whose file has none (`model.sparse.new_head`), created before the file serves
/// the names around it.
pub fn create_mlm_head(
    store: &ParamStore,
    prefix: &str,
    cfg: &BertConfig,
    spec: crate::models::sparse::SparseSpec,
) -> Result<()> {
    // The head is tied to the word embeddings, which the file holds: a stand-in here, as
    // only the head's own variables are being created.
    let table = candle_core::Tensor::zeros(1, store.dtype(), store.device())?;
    Tower::build(store, prefix, |vb| {
        MlmHead::new(cfg, spec, table.clone(), &vb)
    })?;
    Ok(())
}

/// Creates the variables of `cfg`'s classification head under `prefix` in `store`, drawn
/// from its seed as transformers initialises them: the head of a cross-encoder over a
/// plain encoder (`model.reranker.new_head`), created before the file serves the names
/// around it (BERT's pooler included: the whole head starts fresh).
pub fn create_classifier(
    store: &ParamStore,
    prefix: &str,
    cfg: &BertConfig,
    spec: crate::models::classifier::ClassifierSpec,
) -> Result<()> {
    Tower::build(store, prefix, |vb| {
        crate::models::classifier::ClassifierHead::new(cfg, spec, 0, &vb, None)
    })?;
    Ok(())
}

/// Whether the weights of `files` hold `cfg`'s family's classification head (e.g.
/// `classifier.weight`): `Err` names the missing weight and the way out.
pub fn check_classifier(
    files: &ModelFiles,
    cfg: &BertConfig,
    kind: crate::models::classifier::HeadKind,
) -> Result<()> {
    let family = cfg.family(&files.config)?;
    let Some(name) = crate::models::classifier::head_weight(cfg, family, kind) else {
        return Ok(());
    };
    if WeightFile::open(&files.weights, "")?.contains(name) {
        return Ok(());
    }
    Err(Error::InvalidConfig {
        field: "model.pretrained",
        value: format!(
            "{} (no `{name}` in {}: the weights hold no classification head)",
            files.dir.display(),
            files.weights.display()
        ),
        reason: "a cross-encoder scores a pair with its classification head: give a \
                 *ForSequenceClassification model (a sentence-transformers CrossEncoder), or \
                 set model.reranker.new_head = true to create the head from the seed",
    })
}

/// Whether the weights of `files` hold `cfg`'s family's masked-language-model head (its
/// decoder bias, e.g. `cls.predictions.bias`): `Err` names the missing weight.
pub fn check_mlm_head(files: &ModelFiles, cfg: &BertConfig) -> Result<()> {
    let Some(names) = crate::models::sparse::MlmNames::of(cfg.family(&files.config)?) else {
        return Ok(());
    };
    let name = names.bias_name();
    if WeightFile::open(&files.weights, "")?.contains(&name) {
        return Ok(());
    }
    Err(Error::InvalidConfig {
        field: "model.pretrained",
        value: format!(
            "{} (no `{name}` in {}: the weights hold no masked-language-model head)",
            files.dir.display(),
            files.weights.display()
        ),
        reason: "a sparse model pools its MLM head's logits: give a *ForMaskedLM model, or \
                 set model.sparse.new_head = true to create the head from the seed",
    })
}

/// Loads a pretrained BERT tower from a model's files into `store` under `prefix` (`""`
/// for a shared tower). Weight names may carry the `bert.` prefix of Hugging Face
/// `BertFor...` checkpoints or not; the `Dense` modules of `options` read their weights
/// from their directories. Returns the encoder, its config, and the store (which now reads
/// those names from the weights files).
pub fn load_pretrained(
    files: &ModelFiles,
    prefix: &str,
    options: &BertOptions,
    store: ParamStore,
) -> Result<(BertEncoder, BertConfig, ParamStore)> {
    let cfg = BertConfig::from_file(&files.config)?;
    let store = with_model_weights(files, prefix, options, store, false)?;
    let encoder = BertEncoder::build(&store, prefix, &cfg, options)?;
    Ok((encoder, cfg, store))
}
