//! What the benches share.

/// The CPU's model name and vendor, from `/proc/cpuinfo` (`unknown` elsewhere): every
/// figure names the CPU it comes from.
pub fn cpu() -> (String, String) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into())
    };
    (field("model name"), field("vendor_id"))
}
