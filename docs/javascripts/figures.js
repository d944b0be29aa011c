// A figure that the page shows smaller than it is opens at its full size on click, over the page (scrollable
// where it is larger than the window); a click anywhere or Escape closes it. Styles: stylesheets/extra.css.

function closeFigure() {
  document.querySelectorAll(".bsr-figure-overlay").forEach((overlay) => overlay.remove())
}

function openFigure(img) {
  const overlay = document.createElement("div")
  overlay.className = "bsr-figure-overlay"
  const full = document.createElement("img")
  full.src = img.currentSrc || img.src
  full.alt = img.alt
  overlay.appendChild(full)
  overlay.addEventListener("click", closeFigure)
  document.body.appendChild(overlay)
}

function markZoomable(img) {
  const shrunk = img.naturalWidth > img.clientWidth + 1
  img.classList.toggle("bsr-zoomable", shrunk)
  img.title = shrunk ? "Click to open at full size" : ""
}

document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") closeFigure()
})

document$.subscribe(() => {
  for (const img of document.querySelectorAll(".md-content .md-typeset img")) {
    if (img.closest("a")) continue  // a linked image keeps its link
    img.addEventListener("click", () => {
      if (img.classList.contains("bsr-zoomable")) openFigure(img)
    })
    if (img.complete) markZoomable(img)
    else img.addEventListener("load", () => markZoomable(img))
  }
})
window.addEventListener("resize", () => {
  document.querySelectorAll(".md-content .md-typeset img").forEach((img) => { if (img.complete) markZoomable(img) })
})
