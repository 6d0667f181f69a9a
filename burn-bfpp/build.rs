//! Tells the crate whether the burn-autodiff it is built against is the workspace's patched
//! copy (`vendor/burn-autodiff`, which declares `links = "bfpp_autodiff_patch"` and publishes
//! `patched=1` to its direct dependents) or the published 0.21.0: `cfg(bfpp_autodiff_patched)`,
//! read by `model::autodiff::PATCHED_AUTODIFF`.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(bfpp_autodiff_patched)");
    println!("cargo::rerun-if-env-changed=DEP_BFPP_AUTODIFF_PATCH_PATCHED");
    if std::env::var_os("DEP_BFPP_AUTODIFF_PATCH_PATCHED").is_some() {
        println!("cargo::rustc-cfg=bfpp_autodiff_patched");
    }
}
