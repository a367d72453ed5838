//! What the engine chose and why, for the summary and the JSON's
//! `choices`: each flag as asked for or the default's, then what the
//! migration settled (sub-pages kept or dropped, post-copy or not).

use crate::options::{default_codecs, Granularity, MigrateOptions};
use crate::stats::Choice;
use crate::subpage::SubpageStats;

use super::encode::SUBPAGES_PAY;

/// The choices a migration starts with: each flag as asked for, or the
/// default where it says the same; `granularity`, the one it starts with.
/// Post-copy's is settled later ([`postcopy_choice`]).
pub fn initial_choices(options: &MigrateOptions, granularity: Granularity) -> Vec<Choice> {
    let defaults = MigrateOptions::default();
    let why = |same: bool, default: &str| if same { default.to_string() } else { "asked for".to_string() };
    let choice = |what: &str, chose: String, why: String| Choice { what: what.into(), chose, why };
    let start = granularity.bytes;
    let granularity_line = match (granularity.auto, granularity.whole_pages()) {
        (false, _) => choice("granularity", format!("{start} bytes"), "asked for".into()),
        (true, true) => choice(
            "granularity",
            format!("{start} bytes"),
            "auto: whole pages, which zero-copy and the GPU's codecs send".into(),
        ),
        (true, false) => choice(
            "granularity",
            format!("{start} bytes"),
            "auto: sub-pages until the pages sent again show they do not pay".into(),
        ),
    };
    let default = default_codecs(options.zero_copy, options.gpu.is_some());
    let default_why = match default.batch {
        Some(_) => "the default: zero pages as a flag, lz4 over each batch while it pays",
        None => "the default: zero pages as a flag",
    };
    let mut codecs_why = why(options.codecs == default, default_why);
    if options.codecs.xbzrle.is_some() && !granularity.whole_pages() {
        codecs_why.push_str("; XBZRLE codes the pages whose every sub-page changed");
    }
    vec![
        granularity_line,
        choice("codecs", options.codecs.to_string(), codecs_why),
        choice(
            "auto-converge",
            if options.auto_converge { "on" } else { "off" }.into(),
            why(!options.auto_converge, "the default"),
        ),
        choice(
            "post-copy",
            options.postcopy.to_string(),
            why(
                options.postcopy == defaults.postcopy,
                "the default: only a guest that outruns the link is handed over",
            ),
        ),
    ]
}

/// Settles `--granularity auto`'s choice from the sub-page counters of
/// every shard: kept, or whole pages from some iteration on.
pub fn granularity_choice(choices: &mut [Choice], options: &MigrateOptions, subpages: Option<&SubpageStats>) {
    let (Some(sub), true) = (subpages, options.granularity_auto) else { return };
    let Some(choice) = choices.iter_mut().find(|c| c.what == "granularity") else { return };
    let again = match sub.saved_share() {
        Some(saved) => {
            format!("sub-pages saved {:.0} % of the bytes of {} pages sent again", saved * 100.0, sub.resent_pages)
        }
        None => "no page went twice, so sub-pages were not judged".into(),
    };
    match sub.whole_pages_from {
        Some(iteration) => {
            choice.chose = format!("{} bytes, whole pages from iteration {iteration}", sub.granularity);
            choice.why = format!("auto: {again}, under {:.0} %", SUBPAGES_PAY * 100.0);
        }
        None => choice.why = format!("auto: {again}"),
    }
}

/// Settles the post-copy choice: what happened, and why.
pub fn postcopy_choice(choices: &mut Vec<Choice>, chose: String, why: String) {
    let settled = Choice { what: "post-copy".into(), chose, why };
    match choices.iter_mut().find(|c| c.what == "post-copy") {
        Some(c) => *c = settled,
        None => choices.push(settled),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::PostcopyMode;

    #[test]
    fn choices_say_whether_a_flag_or_the_default_chose() {
        let defaults = MigrateOptions::default();
        let mut choices = initial_choices(&defaults, defaults.start_granularity());
        let what: Vec<&str> = choices.iter().map(|c| c.what.as_str()).collect();
        assert_eq!(what, ["granularity", "codecs", "auto-converge", "post-copy"]);
        assert!(choices[0].why.starts_with("auto: sub-pages"), "{choices:?}");
        assert!(choices[1..].iter().all(|c| c.why.starts_with("the default")), "{choices:?}");
        assert_eq!(choices[3].chose, "auto");
        let asked = MigrateOptions {
            granularity: 128,
            granularity_auto: false,
            postcopy: PostcopyMode::Off,
            ..MigrateOptions::default()
        };
        let asked = initial_choices(&asked, asked.start_granularity());
        assert_eq!((asked[0].chose.as_str(), asked[0].why.as_str()), ("128 bytes", "asked for"));
        assert_eq!((asked[3].chose.as_str(), asked[3].why.as_str()), ("off", "asked for"));
        // The outcome replaces the post-copy line.
        postcopy_choice(&mut choices, "not needed".into(), "pre-copy converged".into());
        assert_eq!(choices.len(), 4);
        assert_eq!(choices[3].chose, "not needed");
    }

    #[test]
    fn auto_granularity_says_what_the_sub_pages_saved() {
        let options = MigrateOptions::default();
        let mut choices = initial_choices(&options, options.start_granularity());
        let sub =
            SubpageStats { granularity: 128, resent_pages: 4096, resent_bytes: 4096 * 1024, ..Default::default() };
        granularity_choice(&mut choices, &options, Some(&sub));
        assert_eq!(choices[0].chose, "128 bytes");
        assert_eq!(choices[0].why, "auto: sub-pages saved 75 % of the bytes of 4096 pages sent again");
        let dropped = SubpageStats { resent_bytes: 4096 * 4000, whole_pages_from: Some(2), ..sub };
        granularity_choice(&mut choices, &options, Some(&dropped));
        assert_eq!(choices[0].chose, "128 bytes, whole pages from iteration 2");
        assert!(choices[0].why.ends_with("sent again, under 6 %"), "{:?}", choices[0]);
        // Whole pages from the start where zero-copy sends them.
        let zero_copy = MigrateOptions { zero_copy: true, ..options };
        let zero_copy = initial_choices(&zero_copy, zero_copy.start_granularity());
        assert_eq!(zero_copy[0].chose, "4096 bytes");
    }
}
