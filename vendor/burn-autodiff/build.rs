// burn-bfpp patch: tells the direct dependents that declare burn-autodiff (burn-bfpp) that
// this is the patched copy, through `links` metadata (DEP_BFPP_AUTODIFF_PATCH_PATCHED), so a
// build against the published crate can take the slower, safe path. Not in the published crate.
fn main() {
    println!("cargo::metadata=patched=1");
}
