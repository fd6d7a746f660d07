//! `agent-sandbox image pull|ls|rm|prune`: the image cache from a terminal.

use std::process::ExitCode;

use agent_sandbox::image::{ImageError, ImageRef, ImageStore};
use clap::Subcommand;
use serde_json::json;

use crate::{print_json, EXIT_SANDBOX_FAILED, EXIT_USAGE};

/// What to do with the image cache (`$AGENT_SANDBOX_IMAGE_CACHE`, default
/// `~/.cache/agent-sandbox/images`).
#[derive(Subcommand, Debug)]
pub(crate) enum ImageCmd {
    /// Pull an image into the cache, always asking its source (as `docker pull` does):
    /// `python:3.12-slim`, `ghcr.io/org/img:tag`, `name@sha256:...`, `oci:DIR[:TAG]`,
    /// `docker-archive:FILE`.
    Pull {
        /// The image reference.
        reference: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the cached images.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove an image (by reference, or by digest for all its references), then every
    /// blob and layer no other image needs. Images in use by a live sandbox keep their files
    /// until a later prune.
    Rm {
        /// The reference or manifest digest.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove images no reference names, blobs and layers no image needs, and what pulls
    /// that were killed left behind.
    Prune {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A reference as typed on the command line: relative offline paths made absolute.
pub(crate) fn parse_reference(s: &str) -> Result<ImageRef, String> {
    let absolute = |prefix: &str, rest: &str| -> String {
        let p = std::path::Path::new(rest);
        if p.is_absolute() {
            format!("{prefix}{rest}")
        } else {
            let cwd = std::env::current_dir().unwrap_or_default();
            format!("{prefix}{}", cwd.join(p).display())
        }
    };
    let s = if let Some(rest) = s.strip_prefix("oci:") {
        absolute("oci:", rest)
    } else if let Some(rest) = s.strip_prefix("docker-archive:") {
        absolute("docker-archive:", rest)
    } else {
        s.to_owned()
    };
    ImageRef::parse(&s).map_err(|e| e.to_string())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn fail(e: &ImageError) -> ExitCode {
    eprintln!("agent-sandbox: {e}");
    match e {
        ImageError::NotFound { .. }
        | ImageError::Unauthorized { .. }
        | ImageError::NotCached(_)
        | ImageError::Malformed { .. } => ExitCode::from(EXIT_USAGE),
        _ => ExitCode::from(EXIT_SANDBOX_FAILED),
    }
}

/// Runs one `image` subcommand.
pub(crate) async fn run(cmd: ImageCmd) -> ExitCode {
    let store = match ImageStore::open_default() {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    match cmd {
        ImageCmd::Pull { reference, json } => {
            let r = match parse_reference(&reference) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("agent-sandbox: {e}");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            if !json {
                eprintln!("agent-sandbox: pulling {r} into {}", store.root().display());
            }
            let started = std::time::Instant::now();
            match store.pull(&r).await {
                Ok(img) => {
                    let secs = started.elapsed().as_secs_f64();
                    if json {
                        print_json(&json!({
                            "reference": img.reference(),
                            "digest": img.digest(),
                            "layers": img.layers().len(),
                            "unpacked_bytes": img.unpacked_bytes(),
                            "seconds": secs,
                            "config": img.config(),
                        }));
                    } else {
                        println!(
                            "{} {} ({} layers, {} unpacked, {secs:.1} s)",
                            img.reference(),
                            img.digest(),
                            img.layers().len(),
                            mib(img.unpacked_bytes())
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        ImageCmd::Ls { json } => match store.list() {
            Ok(list) => {
                if json {
                    print_json(
                        &json!({ "images": list, "cache": store.root(), "bytes": store.usage().unwrap_or(0), "max_bytes": store.max_bytes() }),
                    );
                } else {
                    println!(
                        "{:<60} {:<20} {:>7} {:>12}",
                        "REFERENCE", "DIGEST", "LAYERS", "SIZE"
                    );
                    for i in &list {
                        let names = if i.references.is_empty() {
                            vec!["<none>".to_owned()]
                        } else {
                            i.references.clone()
                        };
                        for n in names {
                            println!(
                                "{:<60} {:<20} {:>7} {:>12}{}",
                                n,
                                i.digest.get(..19).unwrap_or(&i.digest),
                                i.layers,
                                mib(i.bytes),
                                if i.in_use { "  (in use)" } else { "" }
                            );
                        }
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        ImageCmd::Rm { name, json } => {
            let name = parse_reference(&name)
                .map(|r| r.to_string())
                .unwrap_or(name);
            report(store.remove(&name), json)
        }
        ImageCmd::Prune { json } => report(store.prune(), json),
    }
}

fn report(
    r: agent_sandbox::image::Result<agent_sandbox::image::PruneReport>,
    json: bool,
) -> ExitCode {
    match r {
        Ok(rep) => {
            if json {
                print_json(&json!(rep));
            } else {
                println!(
                    "removed {} images, {} blobs, {} layers, {} filesystem images; freed {}",
                    rep.images,
                    rep.blobs,
                    rep.layers,
                    rep.fs_images,
                    mib(rep.bytes)
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}
