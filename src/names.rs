//! Which parameters and modules a name or a pattern picks out: `model.freeze`'s patterns,
//! LoRA's targets as PEFT's `target_modules` matches them, the adapters' own names. Plain
//! string matching, shared by the parameter store and the adapters.

/// Whether `pattern` matches `name` as [`crate::params::Freeze`] says, tried on the name
/// with and without its first component (the tower's prefix).
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    let bare = name
        .strip_prefix("query.")
        .or_else(|| name.strip_prefix("passage."));
    [Some(name), bare].into_iter().flatten().any(|n| {
        if pattern.contains('*') {
            glob(pattern.as_bytes(), n.as_bytes())
        } else {
            n == pattern
                || n.strip_prefix(pattern)
                    .is_some_and(|rest| rest.starts_with('.'))
        }
    })
}

/// `*`-only glob matching over the whole text.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// Every family's attention and feed-forward projections, as PEFT's `target_modules`
/// names them: BERT and RoBERTa (`query`, `key`, `value`, the `dense` of
/// `attention.output`, `intermediate` and `output`), MPNet (`attn.q` .. `attn.o`),
/// DistilBERT (`q_lin` .. `out_lin`, `ffn.lin1`, `ffn.lin2`), ModernBERT (`Wqkv`, `Wo`,
/// `Wi`), the decoders and EuroBERT (`q_proj` .. `down_proj`), NomicBERT and Jina v3
/// (`Wqkv`, `out_proj`, `fc11` / `fc12` / `fc2`, `fc1` / `fc2`) and GTE (`qkv_proj`,
/// `o_proj`, `up_gate_proj`, `down_proj`). The default targets.
pub const DEFAULT_TARGETS: [&str; 36] = [
    "query",
    "key",
    "value",
    "dense",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.o",
    "q_lin",
    "k_lin",
    "v_lin",
    "out_lin",
    "ffn.lin1",
    "ffn.lin2",
    "Wqkv",
    "Wo",
    "Wi",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "out_proj",
    "up_gate_proj",
    "fc11",
    "fc12",
    "fc1",
    "fc2",
    "query_proj",
    "key_proj",
    "value_proj",
    "pos_query_proj",
    "pos_key_proj",
];

/// Whether PEFT's `target_modules` entry `target` names the module at `path`: the path
/// itself or its last components (`q_proj` matches `layers.0.self_attn.q_proj`), or with
/// `*` the whole path (as [`pattern_matches`] globs).
pub fn target_matches(target: &str, path: &str) -> bool {
    if target.contains('*') {
        return pattern_matches(target, path);
    }
    path == target
        || path
            .strip_suffix(target)
            .is_some_and(|head| head.ends_with('.'))
}

/// The name of task `t`'s adapter on the module `m` (Jina v3's task adapters, one
/// variable per task and factor): `<m>.lora_A.task<t>` / `<m>.lora_B.task<t>`.
pub fn task_adapter(module: &str, factor: &str, task: usize) -> String {
    format!("{module}.{factor}.task{task}")
}

/// `(module, factor, task)` of a name [`task_adapter`] makes; `None` for another name.
pub fn task_adapter_name(name: &str) -> Option<(&str, &str, usize)> {
    let (rest, task) = name.rsplit_once(".task")?;
    let task = task
        .parse()
        .ok()
        .filter(|_| task.bytes().all(|b| b.is_ascii_digit()))?;
    let (module, factor) = rest.rsplit_once('.')?;
    matches!(factor, "lora_A" | "lora_B").then_some((module, factor, task))
}

/// Whether the parameter `name` belongs to a LoRA adapter.
pub fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.") || name.starts_with("lora_")
}

/// Whether LoRA `targets` (empty: [`DEFAULT_TARGETS`]) name the module at `path`, with or
/// without its tower's prefix.
pub fn targets_module(targets: &[String], path: &str) -> bool {
    let bare = path
        .strip_prefix("query.")
        .or_else(|| path.strip_prefix("passage."))
        .unwrap_or(path);
    if targets.is_empty() {
        return DEFAULT_TARGETS.iter().any(|t| target_matches(t, bare));
    }
    targets.iter().any(|t| target_matches(t, bare))
}

/// Whether the variable named `name` is non-trainable state (a *buffer*, in PyTorch's
/// words): BatchNorm's `running_mean` and `running_var`. Buffers live in the store next to
/// the parameters (so training checkpoints and exports carry them, under PyTorch's names),
/// but receive no gradient and no optimizer update: [`crate::Tower`] keeps them out of
/// its [`crate::params::Params`] and lists them in its buffers instead.
pub fn is_buffer(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}
